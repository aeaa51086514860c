def race_attention(*args, **kwargs):
    raise NotImplementedError("race_attention: work in progress (issue 2)")


def make_planes(num_tables, num_planes, head_dim, seed=0, dtype=None):
    raise NotImplementedError("make_planes: work in progress (issue 2)")
