/* cdcd._arrowcols: a run of rows' column values gathered into Arrow buffers.
 *
 * arrow_columns gives what pa.array gives for the same values, for the Parquet writer
 * (cdcd/sinks/file/parquet_columns.py; tests/unit/test_parquet_columns.py compares the two).
 *
 * docs/development.md says how it is built and when it is used (C_MODULES in cdcd/_purepy.py).
 */
#include "_cdcd.h"

PyDoc_STRVAR(arrow_columns_doc,
"arrow_columns(rows, width) -> list | None\n\n"
"The columns of ``rows`` (a list of tuples of ``width`` values, each bytes or None) as Arrow\n"
"binary arrays' buffers: per column ``(validity, offsets, data, null_count)``, with ``validity``\n"
"None when no value is null, int32 ``offsets``. What ``pa.array(column, pa.binary())`` holds for\n"
"``column = [row[i] for row in rows]``. None when a row is not a tuple of ``width`` values, a\n"
"value is neither bytes nor None, or a column holds 2 GiB or more: the caller then takes its\n"
"Python path (cdcd.sinks.file.parquet_columns, ColumnBuilder._image).");

static PyObject *arrow_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "arrow_columns(rows: list, width: int)");
        return NULL;
    }
    PyObject *rows = args[0];
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    if (width < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "arrow_columns: negative width");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    Py_ssize_t *lengths = PyMem_Calloc((size_t)(width ? width : 1), sizeof(Py_ssize_t));
    Py_ssize_t *nulls = PyMem_Calloc((size_t)(width ? width : 1), sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (lengths == NULL || nulls == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t r = 0; r < n; r++) { /* sizes, and whether this path can take them */
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != width)
            goto python_path;
        for (Py_ssize_t c = 0; c < width; c++) {
            PyObject *v = PyTuple_GET_ITEM(row, c);
            if (v == Py_None)
                nulls[c]++;
            else if (PyBytes_Check(v))
                lengths[c] += PyBytes_GET_SIZE(v);
            else
                goto python_path;
        }
    }
    for (Py_ssize_t c = 0; c < width; c++)
        if (lengths[c] > INT32_MAX)
            goto python_path;
    out = PyList_New(width);
    if (out == NULL)
        goto done;
    for (Py_ssize_t c = 0; c < width; c++) {
        PyObject *offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
        PyObject *data = PyBytes_FromStringAndSize(NULL, lengths[c]);
        PyObject *validity = NULL;
        if (offsets == NULL || data == NULL)
            goto column_failed;
        if (nulls[c] > 0) {
            validity = PyBytes_FromStringAndSize(NULL, (n + 7) / 8);
            if (validity == NULL)
                goto column_failed;
            memset(PyBytes_AS_STRING(validity), 0, (size_t)((n + 7) / 8));
        }
        int32_t *off = (int32_t *)PyBytes_AS_STRING(offsets);
        char *d = PyBytes_AS_STRING(data);
        unsigned char *bits = validity ? (unsigned char *)PyBytes_AS_STRING(validity) : NULL;
        int32_t at = 0;
        for (Py_ssize_t r = 0; r < n; r++) {
            PyObject *v = PyTuple_GET_ITEM(PyList_GET_ITEM(rows, r), c);
            off[r] = at;
            if (v != Py_None) {
                Py_ssize_t len = PyBytes_GET_SIZE(v);
                memcpy(d + at, PyBytes_AS_STRING(v), (size_t)len);
                at += (int32_t)len;
                if (bits)
                    bits[r >> 3] |= (unsigned char)(1u << (r & 7));
            }
        }
        off[n] = at;
        PyObject *item = Py_BuildValue("(NNNn)", validity ? validity : Py_NewRef(Py_None),
                                       offsets, data, nulls[c]);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, c, item);
        continue;
    column_failed:
        Py_XDECREF(offsets);
        Py_XDECREF(data);
        Py_XDECREF(validity);
        Py_CLEAR(out);
        goto done;
    }
    goto done;
python_path:
    out = Py_NewRef(Py_None);
done:
    PyMem_Free(lengths);
    PyMem_Free(nulls);
    return out;
}

CDCD_ONE_FUNCTION_MODULE(_arrowcols, arrow_columns, "A run of rows' column values as Arrow buffers (see cdcd/_arrowcols.c).")
