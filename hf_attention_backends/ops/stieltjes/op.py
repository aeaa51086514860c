def stieltjes_attention(*args, **kwargs):
    raise NotImplementedError("stieltjes_attention: work in progress (issue 2)")
