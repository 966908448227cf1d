/* What cdcd's hand-written C extensions share (cdcd/_rowjson.c, _kafkarec.c, _arrowcols.c,
 * _xlog.c, _tupledata.c: one module per job, listed in C_MODULES in cdcd/_purepy.py, which
 * says how they are built and when they are used; docs/development.md). */
#ifndef CDCD_C_H
#define CDCD_C_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* big-endian integers, as the PostgreSQL protocol writes them */
static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t be64(const unsigned char *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

/* a METH_FASTCALL function in a PyMethodDef */
#define CDCD_FASTCALL(fn) ((PyCFunction)(void (*)(void))(fn)), METH_FASTCALL

/* The module ``cdcd.<leaf>`` holding the one function ``fn`` (its docstring ``fn##_doc``):
 * defines its PyInit. */
#define CDCD_ONE_FUNCTION_MODULE(leaf, fn, doc)                                               \
    static PyMethodDef leaf##_methods[] = {                                                   \
        {#fn, CDCD_FASTCALL(fn), fn##_doc},                                                   \
        {NULL, NULL, 0, NULL},                                                                \
    };                                                                                        \
    static PyModuleDef_Slot leaf##_slots[] = {{0, NULL}};                                     \
    static struct PyModuleDef leaf##_def = {                                                  \
        PyModuleDef_HEAD_INIT, "cdcd." #leaf, doc, 0, leaf##_methods, leaf##_slots, NULL,     \
        NULL, NULL,                                                                           \
    };                                                                                        \
    PyMODINIT_FUNC PyInit_##leaf(void) { return PyModuleDef_Init(&leaf##_def); }

#endif
