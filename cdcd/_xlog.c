/* cdcd._xlog: the replication stream's CopyData messages split into XLogData tuples.
 *
 * xlog_run takes what the Python loop of MessageReader.next_xlog_run (cdcd/wire/framing.py)
 * takes (tests/unit/test_stream_batches.py runs both on generated streams cut anywhere).
 *
 * docs/development.md says how it is built and when it is used (C_MODULES in cdcd/_purepy.py).
 */
#include "_cdcd.h"

PyDoc_STRVAR(xlog_run_doc,
"xlog_run(buf, pos, max_bytes, max_message) -> (items, others, pos)\n\n"
"What ``MessageReader.next_xlog_run`` takes from the bytearray ``buf`` at ``pos``: the complete\n"
"CopyData (``d``) messages in a row, each XLogData as ``(wal_start, wal_end, send_time, data)``\n"
"and any other payload as bytes (its index in ``others``), until ``max_bytes`` of payload were\n"
"taken; and the position after them. It stops, taking nothing more, at a message with another\n"
"tag, an incomplete one, or a length below 4 or above ``max_message`` (the Python path then\n"
"raises for that: cdcd/wire/framing.py).");

static PyObject *xlog_tuple(const unsigned char *m, Py_ssize_t data_len) {
    PyObject *t = PyTuple_New(4);
    if (t == NULL)
        return NULL;
    PyObject *v;
    if ((v = PyLong_FromUnsignedLongLong(be64(m + 1))) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 0, v);
    if ((v = PyLong_FromUnsignedLongLong(be64(m + 9))) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 1, v);
    if ((v = PyLong_FromLongLong((long long)be64(m + 17))) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 2, v);
    if ((v = PyBytes_FromStringAndSize((const char *)m + 25, data_len)) == NULL)
        goto error;
    PyTuple_SET_ITEM(t, 3, v);
    return t;
error:
    Py_DECREF(t);
    return NULL;
}

static PyObject *xlog_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4 || !PyByteArray_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError,
                        "xlog_run(buf: bytearray, pos: int, max_bytes: int, max_message: int)");
        return NULL;
    }
    PyObject *buf = args[0];
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    long long max_bytes = PyLong_AsLongLong(args[2]);
    long long max_message = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (pos < 0 || pos > PyByteArray_GET_SIZE(buf)) {
        PyErr_SetString(PyExc_ValueError, "xlog_run: pos outside the buffer");
        return NULL;
    }
    PyObject *items = PyList_New(0);
    PyObject *others = PyList_New(0);
    if (items == NULL || others == NULL)
        goto error;
    long long taken = 0;
    for (;;) {
        /* read again each time: nothing here resizes buf, but allocations may run Python code */
        Py_ssize_t size = PyByteArray_GET_SIZE(buf);
        const unsigned char *b = (const unsigned char *)PyByteArray_AS_STRING(buf);
        if (size - pos < 5 || taken >= max_bytes || b[pos] != 'd')
            break;
        uint32_t length = be32(b + pos + 1);
        if (length < 4 || (long long)length > max_message)
            break;
        Py_ssize_t end = pos + 1 + (Py_ssize_t)length;
        if (end > size)
            break;
        const unsigned char *m = b + pos + 5;
        Py_ssize_t len = end - pos - 5;
        PyObject *item;
        if (len >= 25 && m[0] == 'w') {
            item = xlog_tuple(m, len - 25);
        } else {
            PyObject *index = PyLong_FromSsize_t(PyList_GET_SIZE(items));
            if (index == NULL || PyList_Append(others, index) < 0) {
                Py_XDECREF(index);
                goto error;
            }
            Py_DECREF(index);
            item = PyBytes_FromStringAndSize((const char *)m, len);
        }
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            goto error;
        }
        Py_DECREF(item);
        taken += end - pos - 1;
        pos = end;
    }
    return Py_BuildValue("(NNn)", items, others, pos);
error:
    Py_XDECREF(items);
    Py_XDECREF(others);
    return NULL;
}

CDCD_ONE_FUNCTION_MODULE(_xlog, xlog_run, "The replication stream's CopyData messages as XLogData tuples (see cdcd/_xlog.c).")
