// Entry point of hf_attention_backends._C. The module has no Python functions: importing it runs the
// TORCH_LIBRARY_IMPL(hfab, CUDA, m) registrations in csrc/<backend>/*.cu, which give the hfab::* ops
// (schemas defined in Python, hf_attention_backends/ops/*/op.py) their CUDA kernels.
#include <Python.h>

static PyModuleDef hfab_module = {PyModuleDef_HEAD_INIT, "_C",
                                  "CUDA kernels of hf_attention_backends (registered as hfab::* torch ops).", -1,
                                  nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&hfab_module); }
