// torch_moe_a2a._C: an empty Python module. Importing it loads this shared
// library, whose static TORCH_LIBRARY / TORCH_LIBRARY_IMPL registrations define
// torch.ops.moe_a2a.*; the operators themselves need no Python binding.
#include <Python.h>

namespace {

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Loads the torch.ops.moe_a2a operator library.",
    -1,       // no per-module state
    nullptr,  // m_methods
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module_def); }
