"""Float64 CPU emulation of the tensor-core RACE key side (csrc/race/race_tc_bwd_kernels.cuh, "key side").

Emulates race_group_qstate_bwd_kernel (per group: sum of phi~(q) [dO, c^]^T over the group's query tiles), the
reverse group scan, and race_group_dkv_bwd_kernel (per key-chunk group and kv head: the GQA group's q heads in
order, the group's chunks in reverse order from the suffix state: dv, dphi(k), w, dk, the k-side dbeta; then
state += the chunk's query tile), with the kernels' chunking (s0, kappa0, groups of `group` chunks), masks and
dead rows (1/den = 0). Checks dk, dv and the k-side dbeta against autograd of a dense float64 oracle in which
phi(k) has its own beta (dk, dv also against autograd of ops/race/reference.py). Run:
PYTHONPATH=. python scripts/race_tc_dkv_emulation.py [--precision] (CPU; --precision: the kernels' roundings, minutes).
"""
import itertools
import math

import torch

from hf_attention_backends.ops.race import reference

C = 64


class Exact:
    """The kernels' operand roundings as identities (checks indexing and the recurrences)."""

    def f32(self, x):
        return x

    def t(self, x):  # an fp32 value rounded to the input dtype T (fp16 phi of the forward's scores)
        return x

    def split_t(self, x, scaled=True):  # two T halves (hi + lo) of an fp32 value, rows scaled by a power of 2 first
        return x

    def split_tf32(self, x):
        return x


class Rounded(Exact):
    """Float64 with the kernels' casts: fp32 intermediates, T halves, tf32 halves (cvt.rna)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def f32(self, x):
        return x.float().double()

    def t(self, x):
        return x.float().to(self.dtype).double()

    def split_t(self, x, scaled=True):
        x = x.float().double()
        mx = x.abs().amax(dim=-1, keepdim=True)
        ex = torch.frexp(mx)[1] - 1  # row max * 2^-ex in [1, 2)
        ex = torch.where((mx > 0) & scaled, ex.clamp(min=-126), torch.zeros_like(ex))
        y = x * torch.pow(2.0, -ex.double())
        hi = self.t(y)
        return (hi + self.t(y - hi)) * torch.pow(2.0, ex.double())

    @staticmethod
    def tf32(x):
        bits = x.float().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()

    def split_tf32(self, x):
        x = x.float().double()
        hi = self.tf32(x)
        return hi + self.tf32(x - hi)


def tables(x, planes, beta):
    """u (N, L*P) and phi (N, S) of rows x (N, D) in float64."""
    num_tables, num_planes, d = planes.shape
    u = torch.tanh(x @ planes.reshape(-1, d).T)
    corners = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=num_planes)), dtype=torch.float64)
    logits = beta * u.view(-1, num_tables, num_planes) @ corners.T
    return u, torch.softmax(logits, dim=-1).flatten(1)


def dense_scores(q, k, planes, beta_q, beta_k, mask, causal, b, h):
    """phi(q) phi(k)^T of batch b, q head h (its kv head h // groups), masked (causal bottom-right, padding)."""
    nq, nk, groups = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    _, pq = tables(q[b, h], planes, beta_q[h])
    _, pk = tables(k[b, h // groups], planes, beta_k[h])
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    allowed = (j <= i + nk - nq) if causal else torch.ones(nq, nk, dtype=torch.bool)
    if mask is not None:
        allowed = allowed & mask[b][None, :]
    return (pq @ pk.T) * allowed


def dense(q, k, v, planes, beta_q, beta_k, mask, causal):
    """Dense oracle with separate betas for phi(q) and phi(k) (per q head)."""
    hq = q.shape[1]
    groups = hq // k.shape[1]
    out = []
    for b in range(q.shape[0]):
        heads = []
        for h in range(hq):
            a = dense_scores(q, k, planes, beta_q, beta_k, mask, causal, b, h)
            den = a.sum(-1, keepdim=True)
            heads.append(torch.where(den > 0, a @ v[b, h // groups] / torch.where(den > 0, den, 1.0), 0.0 * den))
        out.append(torch.stack(heads))
    return torch.stack(out)


def emulate(q, k, v, dout, planes, beta, mask, causal, group=16, ops=Exact()):
    """dk, dv, the k-side dbeta per q head, as the kernels compute them (float64 with `ops`' roundings; den and c,
    the dq kernel's outputs, exact rounded to fp32)."""
    bsz, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    groups = hq // hkv
    num_tables, num_planes, _ = planes.shape
    lp, R = num_tables * num_planes, 2 ** num_planes
    W = planes.reshape(lp, d)
    if isinstance(ops, Rounded):  # projections use W in two T halves (the forward's init_constants)
        hi = ops.t(planes)
        planes = hi + ops.t(planes - hi)
    # chunking as prepare() (race_host.cuh)
    s0 = kappa0 = 0
    if causal:
        off = nk - nq
        s0 = off % C
        if s0 > 0:
            s0 -= C
        kappa0 = (off - s0) // C
    nkc, nqt = -(-(nk - s0) // C), -(-nq // C)
    assert not causal or nkc == kappa0 + nqt
    ngk, ngq = -(-nkc // group), -(-nqt // group)
    ng = ngk if causal else ngq
    # den, c (the dq kernel's outputs) from the dense forward
    with torch.no_grad():
        den = torch.zeros(bsz, hq, nq, dtype=torch.float64)
        cq = torch.zeros_like(den)
        for b in range(bsz):
            for h in range(hq):
                a = dense_scores(q, k, planes, beta, beta, mask, causal, b, h)
                dn = a.sum(-1)
                o = torch.where(dn[:, None] > 0, a @ v[b, h // groups] / torch.where(dn > 0, dn, 1.0)[:, None], 0.0)
                den[b, h] = dn
                cq[b, h] = torch.where(dn > 0, (dout[b, h] * o).sum(-1) / torch.where(dn > 0, dn, 1.0), 0.0)
        den, cq = ops.f32(den), ops.f32(cq)

    def query_tile(b, h, m):
        """phi(q), 1/den, c^ = c den, dO of tile m (rows >= Nq and dead rows: 1/den = 0)."""
        rows = torch.arange(m * C, m * C + C)
        ok = rows < nq
        rr = rows.clamp(max=nq - 1)
        x = torch.where(ok[:, None], q[b, h, rr], 0.0)
        _, ph = tables(x, planes, beta[h])
        dn = torch.where(ok, den[b, h, rr], 0.0)
        live = dn > 0
        inv = ops.f32(torch.where(live, 1.0 / torch.where(live, dn, 1.0), 0.0))
        chat = ops.f32(torch.where(live, cq[b, h, rr] * dn, 0.0))
        do = torch.where(ok[:, None], dout[b, h, rr], 0.0)
        return ph, inv, chat, do

    def tile_state(ph, inv, chat, do):
        """phi~^T [dO, c^]: phi~ = phi / den and c^ in two tf32 halves, dO exact."""
        return ops.split_tf32(ph * inv[:, None]).T @ torch.cat([do, ops.split_tf32(chat)[:, None]], 1)

    # step (2): group sums, then the reverse scan (slot g + 1: groups after g; slot 0: total)
    qstate = torch.zeros(bsz, hq, ng + 1, num_tables * R, d + 1, dtype=torch.float64)
    for b in range(bsz):
        for h in range(hq):
            for grp in range(ng):
                items = range(grp * group, min(nkc if causal else nqt, grp * group + group))
                for it in items:
                    m = it - kappa0 if causal else it
                    if m < 0:
                        continue
                    ph, inv, chat, do = query_tile(b, h, m)
                    qstate[b, h, grp] += tile_state(ph, inv, chat, do)
            qstate[b, h] = ops.f32(qstate[b, h])
            run = torch.zeros_like(qstate[b, h, 0])
            for top in range(ng - 1, -2, -1):
                inp = qstate[b, h, top].clone() if top >= 0 else None
                qstate[b, h, top + 1] = run
                if inp is not None:
                    run = ops.f32(run + inp)
    # step (3)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dbeta_k = torch.zeros(bsz, hq, nkc, dtype=torch.float64)
    for b in range(bsz):
        for hk in range(hkv):
            for grp in range(ngk):
                first, end = grp * group, min(nkc, grp * group + group)
                for g in range(groups):
                    h = hk * groups + g
                    st = qstate[b, h, grp + 1 if causal else 0].clone()
                    for kappa in range(end - 1, first - 1, -1):
                        m = kappa - kappa0 if causal else -1
                        intra = m >= 0
                        keys = torch.arange(s0 + kappa * C, s0 + kappa * C + C)
                        okk = (keys >= 0) & (keys < nk)
                        kk_ = keys.clamp(0, nk - 1)
                        if mask is not None:
                            okk = okk & mask[b, kk_]
                        xk = torch.where(okk[:, None], k[b, hk, kk_], 0.0)
                        vk = torch.where(okk[:, None], v[b, hk, kk_], 0.0)
                        uk, phk = tables(xk, planes, beta[h])
                        phk = phk * okk[:, None]
                        B, y = st[:, :d], st[:, d]
                        Bt = ops.split_tf32(B)
                        dvc = ops.split_tf32(phk) @ Bt
                        dphi = vk @ Bt.T - y[None, :]
                        if intra:
                            phq, inv, chat, do = query_tile(b, h, m)
                            tri = torch.arange(C)[:, None] <= torch.arange(C)[None, :]  # key j <= query i
                            sc = ops.f32((ops.t(phk) @ ops.t(phq).T) * tri)
                            dvc = dvc + ops.split_t(sc * inv[None, :]) @ do
                            ds = ops.f32(vk @ do.T)
                            ds = torch.where(tri, ops.f32(ops.f32(ds - chat[None, :]) * inv[None, :]), 0.0)
                            dphi = dphi + ops.split_t(ds) @ ops.split_t(phq, scaled=False)
                        gg = (dphi * phk).view(C, num_tables, R)
                        sp = torch.sigmoid(2 * beta[h] * uk).view(C, num_tables, num_planes)
                        sm = torch.sigmoid(-2 * beta[h] * uk).view(C, num_tables, num_planes)
                        bits = torch.tensor([[(r >> (num_planes - 1 - t)) & 1 for t in range(num_planes)]
                                             for r in range(R)], dtype=torch.bool)  # (R, P)
                        set_ = torch.einsum("clr,rt->clt", gg, bits.double())
                        clear = torch.einsum("clr,rt->clt", gg, (~bits).double())
                        w = (sm * set_ - sp * clear).reshape(C, lp)
                        dkc = (2 * beta[h] * w * (1 - uk ** 2)) @ W
                        dbeta_k[b, h, kappa] = (2 * uk * w * okk[:, None]).sum()
                        sel = okk.nonzero().flatten()
                        dk[b, hk, keys[sel]] += dkc[sel]
                        dv[b, hk, keys[sel]] += dvc[sel]
                        if intra and kappa > first:
                            ph, inv, chat, do = query_tile(b, h, m)
                            st = ops.f32(st + tile_state(ph, inv, chat, do))
    return dk, dv, dbeta_k.sum(dim=(0, 2))


def check(bsz, hq, hkv, nq, nk, d, num_planes, num_tables, causal, padding, group, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hq, nq, d, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, hkv, nk, d, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, hkv, nk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(bsz, hq, nq, d, generator=g, dtype=torch.float64)
    planes = torch.randn(num_tables, num_planes, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    beta = torch.linspace(0.5, 1.5, hq, dtype=torch.float64) * 2.0
    mask = None
    if padding:
        mask = torch.ones(bsz, nk, dtype=torch.bool)
        mask[0, : nk // 3] = False  # left padding
        if bsz > 1:
            mask[1, nk - nk // 4:] = False  # right padding
        if bsz > 2:
            mask[2] = False  # no real key
    leaves = [t.clone().requires_grad_(True) for t in (k, v, beta)]
    out = dense(q, leaves[0], leaves[1], planes, beta, leaves[2], mask, causal)
    want = torch.autograd.grad(out, leaves, dout)
    # dk, dv of the package's reference (the op's spec) too: the dense oracle is this test's own
    ref_leaves = [t.clone().requires_grad_(True) for t in (k, v)]
    ref = reference.race_forward(q, *ref_leaves, planes, beta, mask, causal)
    want_ref = torch.autograd.grad(ref, ref_leaves, dout)
    got = emulate(q, k, v, dout, planes, beta, mask, causal, group)
    rel = [float((x - y).abs().max() / (1.0 + y.abs().max())) for x, y in zip(got, want)]
    rel_ref = [float((x - y).abs().max() / (1.0 + y.abs().max())) for x, y in zip(got, want_ref)]
    return [max(a, b) for a, b in zip(rel, rel_ref)] + rel[2:]


def precision(dtype, nq, nk, d, num_planes, num_tables, causal, scale, beta_mult, seed=0):
    """The kernels' roundings on dtype inputs vs the tests' rule (tests/ops/test_race_cuda.py): max error of dk, dv
    against float64 over the error of the PyTorch reference (fp32 compute, rounded to dtype); the k-side dbeta error
    over the tests' dbeta floor 1e-4 (1 + max|dbeta|)."""
    import hf_attention_backends as hfab

    hq, hkv = 2, 1
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, hq, nq, d, generator=g) * scale).to(dtype)
    k = (torch.randn(1, hkv, nk, d, generator=g) * scale).to(dtype)
    v = torch.randn(1, hkv, nk, d, generator=g).to(dtype)
    dout = torch.randn(1, hq, nq, d, generator=g).to(dtype)
    planes = hfab.make_planes(num_tables, num_planes, d, seed=num_planes).float()
    beta = (torch.linspace(0.5, 1.5, hq) * d ** -0.5 * beta_mult).float()
    q64, k64, v64, do64, pl64, b64 = (t.double() for t in (q, k, v, dout, planes, beta))
    leaves = [t.clone().requires_grad_(True) for t in (k64, v64, b64, b64)]
    out = dense(q64, leaves[0], leaves[1], pl64, leaves[3], leaves[2], None, causal)
    dk64, dv64, dbk64, dbq64 = torch.autograd.grad(out, leaves, do64)
    ref_leaves = [t.clone().requires_grad_(True) for t in (k, v)]
    ref = reference.race_forward(q, *ref_leaves, planes, beta, None, causal)
    dk_ref, dv_ref = torch.autograd.grad(ref, ref_leaves, dout)
    dk, dv, dbk = emulate(q64, k64, v64, do64, pl64, b64, None, causal, ops=Rounded(dtype))
    dk, dv = dk.to(dtype).double(), dv.to(dtype).double()

    def ratio(got, want, base):
        return float((got - want).abs().max()) / float((base.double() - want).abs().max())

    floor = 1e-4 * (1.0 + float((dbk64 + dbq64).abs().max()))
    return ratio(dk, dk64, dk_ref), ratio(dv, dv64, dv_ref), float((dbk - dbk64).abs().max()) / floor


def main_precision():
    torch.set_num_threads(1)
    worst = {}
    for dtype in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            for (num_planes, num_tables), scale, beta_mult in [((4, 4), 1.0, 1.0), ((4, 4), 0.05, 1.0),
                                                                ((4, 4), 10.0, 1.0), ((4, 4), 3.0, 10.0),
                                                                ((6, 1), 2.0, 1.0), ((3, 8), 2.0, 1.0),
                                                                ((1, 1), 1.0, 1.0)]:
                r = precision(dtype, 333, 333, 64, num_planes, num_tables, causal, scale, beta_mult)
                print(f"{str(dtype)[6:]:8s} causal={causal!s:5s} P={num_planes} L={num_tables} x{scale:<5} "
                      f"beta x{beta_mult:<4}: dk {r[0]:.2f}  dv {r[1]:.2f}  dbeta_k/floor {r[2]:.3f}")
                key = str(dtype)[6:]
                worst[key] = [max(a, b) for a, b in zip(worst.get(key, [0, 0, 0]), r)]
    for key, r in worst.items():
        print(f"worst {key}: dk {r[0]:.2f}, dv {r[1]:.2f} (tests allow 2 + floor), dbeta_k {r[2]:.3f} of the floor")


def main():
    torch.set_num_threads(1)  # small matrices: threads only add overhead
    cases = []
    for causal in (False, True):
        for nq, nk in [(1, 1), (7, 7), (63, 63), (64, 64), (65, 65), (333, 333), (1, 333), (65, 333), (63, 64),
                       (64, 65), (130, 200), (64, 192), (70, 33), (200, 65), (65, 1), (128, 64)]:
            cases.append((1, 2, 1, nq, nk, 32, 4, 4, causal, False, 16))
        if causal:  # 2 groups of 16 chunks; key chunks before the first query tile
            cases += [(1, 2, 1, 1100, 1100, 32, 4, 4, True, False, 16), (1, 2, 1, 7, 1100, 32, 4, 4, True, False, 16)]
        cases.append((2, 4, 2, 333, 333, 32, 4, 4, causal, False, 2))      # many groups, GQA 2:1
        cases.append((3, 4, 2, 333, 333, 32, 3, 2, causal, True, 2))       # padding, a row with no key
        cases.append((3, 2, 2, 65, 65, 32, 4, 4, causal, True, 16))
        cases.append((2, 6, 2, 200, 333, 32, 2, 3, causal, True, 1))       # GQA 3:1, one chunk per group
        cases.append((2, 4, 1, 333, 200, 32, 6, 1, causal, False, 3))      # Nq > Nk, GQA 4:1
        cases.append((1, 2, 1, 260, 130, 32, 1, 1, causal, True, 2))
    worst = [0.0, 0.0, 0.0]
    for i, c in enumerate(cases):
        errs = check(*c, seed=i)
        worst = [max(a, e) for a, e in zip(worst, errs)]
        assert max(errs) < 1e-10, (c, errs)
    print(f"{len(cases)} cases; max |emulated - autograd| / (1 + max|autograd|) (dk, dv: also vs ops.race.reference): "
          f"dk {worst[0]:.2e}, dv {worst[1]:.2e}, dbeta(k side) {worst[2]:.2e}")


if __name__ == "__main__":
    import sys

    main_precision() if "--precision" in sys.argv else main()
