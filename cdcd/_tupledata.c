/* cdcd._tupledata: pgoutput's TupleData read in one pass.
 *
 * parse_tuple returns what cdcd.decoder.tuples.parse_tuple_python returns, and declines
 * (None) wherever that one raises (tests/unit/test_accel.py runs both on generated tuples).
 *
 * docs/development.md says how it is built and when it is used (C_MODULES in cdcd/_purepy.py).
 */
#include "_cdcd.h"

PyDoc_STRVAR(parse_tuple_doc,
"parse_tuple(buf, pos) -> (kinds, values, end) | None\n\n"
"What ``cdcd.decoder.tuples.parse_tuple_python`` returns for the TupleData at ``pos`` of the\n"
"bytes ``buf``: its kind bytes, its values (bytes for 't'/'b' columns, None otherwise) and the\n"
"position after it. None where that one raises or returns a position past the end (a length\n"
"or kind running past the end, an unknown kind): the Python path then says what is wrong.");

static PyObject *parse_tuple(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || !PyLong_CheckExact(args[1]))
        Py_RETURN_NONE;  /* the Python path takes anything else */
    PyObject *buf = args[0];
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(buf);
    Py_ssize_t size = PyBytes_GET_SIZE(buf);
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (pos < 0 || size - pos < 2)
        Py_RETURN_NONE;
    Py_ssize_t ncols = ((Py_ssize_t)b[pos] << 8) | b[pos + 1];
    pos += 2;
    PyObject *kinds = PyBytes_FromStringAndSize(NULL, ncols);
    PyObject *values = PyTuple_New(ncols);
    if (kinds == NULL || values == NULL)
        goto error;
    char *k = PyBytes_AS_STRING(kinds);
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (pos >= size)
            goto malformed;
        unsigned char kind = b[pos];
        PyObject *value;
        if (kind == 't' || kind == 'b') {
            if (size - pos < 5)
                goto malformed;
            uint32_t length = be32(b + pos + 1);
            pos += 5;
            if ((uint64_t)length > (uint64_t)(size - pos))
                goto malformed;
            value = PyBytes_FromStringAndSize((const char *)b + pos, (Py_ssize_t)length);
            if (value == NULL)
                goto error;
            pos += (Py_ssize_t)length;
        } else if (kind == 'n' || kind == 'u') {
            value = Py_None;
            Py_INCREF(value);
            pos += 1;
        } else {
            goto malformed;
        }
        k[i] = (char)kind;
        PyTuple_SET_ITEM(values, i, value);
    }
    PyObject *end = PyLong_FromSsize_t(pos);
    if (end == NULL)
        goto error;
    PyObject *result = PyTuple_New(3);
    if (result == NULL) {
        Py_DECREF(end);
        goto error;
    }
    PyTuple_SET_ITEM(result, 0, kinds);
    PyTuple_SET_ITEM(result, 1, values);
    PyTuple_SET_ITEM(result, 2, end);
    return result;
malformed:
    Py_DECREF(kinds);
    Py_DECREF(values);
    Py_RETURN_NONE;
error:
    Py_XDECREF(kinds);
    Py_XDECREF(values);
    return NULL;
}

CDCD_ONE_FUNCTION_MODULE(_tupledata, parse_tuple, "pgoutput's TupleData read in one pass (see cdcd/_tupledata.c).")
