def enable_backend(model, name, **config):
    raise NotImplementedError("enable_backend: work in progress (issue 3)")


def disable_backend(model):
    raise NotImplementedError("disable_backend: work in progress (issue 3)")
