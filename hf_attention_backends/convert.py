def convert(model, backend, layers=None, **config):
    raise NotImplementedError("convert: work in progress (issue 3)")


def from_pretrained(path, **kwargs):
    raise NotImplementedError("from_pretrained: work in progress (issue 3)")
