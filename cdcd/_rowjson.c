/* cdcd._rowjson: a row's JSON written straight from pgoutput's column bytes.
 *
 * What it computes is defined by the pure-Python path it replaces, and the tests compare the two
 * (tests/unit/test_rowjson.py): row_json(...) returns exactly
 *
 *     orjson.dumps({name: convert(value) for each selected column})
 *
 * where convert is the column's JSON converter (cdcd.values.types.RowDecoder, target "json").
 * For the column types whose text form needs no Python value (integers, floats, booleans,
 * text-like types, timestamps) the bytes are copied, quoted or escaped here; every other value goes through
 * its converter and `dumps` (orjson.dumps), so nothing about a type's JSON form lives only here.
 * Whenever a fast path's conditions do not hold (an integer with a sign or leading zeros, text
 * that is not valid UTF-8, a timestamp in another form) the value takes the converter too: the
 * converter then gives the same value, or raises the error the pure-Python path raises.
 *
 * It also gathers a run of rows' column values into Arrow buffers (arrow_columns), what
 * pa.array gives for the same values (tests/unit/test_parquet_columns.py), and writes Kafka records into a record batch's buffer (kafka_record), exactly as
 * cdcd.sinks.kafka.recordbatch.write_record_python does (tests/unit/test_kafka_recordbatch.py).
 *
 * docs/development.md says how it is built and when it is used (cdcd/_purepy.py,
 * C_MODULES: setup.py builds it beside the mypyc modules, with the same build record).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* column codes: cdcd.values.types.JSON_* */
enum {
    J_CONVERT = 0,   /* converter(value), then dumps */
    J_INT = 1,       /* int: PostgreSQL's text is the JSON number when canonical */
    J_BOOL = 2,      /* vt.bool_value: b == b"t" */
    J_STRING = 3,    /* bytes.decode(): a JSON string */
    J_TIMESTAMPTZ = 4, /* vt.timestamptz_json */
    J_TIMESTAMP = 5, /* vt.timestamp_json */
    J_FLOAT = 6,     /* vt.float_json: float(text), which orjson writes in shortest form */
};

#define KIND_NULL 'n'
#define KIND_UNCHANGED 'u'
#define KIND_TEXT 't'
#define KIND_BINARY 'b'

/* Output: in `small`, then on the heap; or, after buf_chunked, in bytes objects of about
 * CHUNK bytes that buf_finish returns as a list. A large output in pieces of that size is
 * allocated from the heap's free lists, not mapped afresh (and faulted in) for each batch,
 * and is never copied once written. */
typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
    PyObject *obj;     /* chunked: the piece being written, `data` is its bytes */
    PyObject *pieces;  /* chunked: the pieces before it */
    char small[1024];
} Buf;

/* below glibc's threshold for mapping an allocation on its own (128 KiB at least) */
#define CHUNK ((Py_ssize_t)(64 * 1024 - 64))

static int buf_new_piece(Buf *b, Py_ssize_t cap) {
    b->obj = PyBytes_FromStringAndSize(NULL, cap);
    if (b->obj == NULL)
        return -1;
    b->data = PyBytes_AS_STRING(b->obj);
    b->len = 0;
    b->cap = cap;
    return 0;
}

/* The piece being written, cut to what was written, appended to the pieces. */
static int buf_end_piece(Buf *b) {
    PyObject *obj = b->obj;
    Py_ssize_t len = b->len;
    b->obj = NULL;
    b->data = b->small;
    b->len = 0;
    b->cap = (Py_ssize_t)sizeof(b->small);
    if (obj == NULL)
        return 0;
    if (len == 0) {
        Py_DECREF(obj);
        return 0;
    }
    if (_PyBytes_Resize(&obj, len) < 0)
        return -1;
    int rc = PyList_Append(b->pieces, obj);
    Py_DECREF(obj);
    return rc;
}

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    Py_ssize_t need = b->len + extra;
    if (need <= b->cap)
        return 0;
    if (b->pieces != NULL) {
        if (buf_end_piece(b) < 0)
            return -1;
        return buf_new_piece(b, extra > CHUNK ? extra : CHUNK);
    }
    Py_ssize_t cap = b->cap * 2;
    if (cap < need)
        cap = need;
    char *data;
    if (b->data == b->small) {
        data = PyMem_Malloc((size_t)cap);
        if (data != NULL)
            memcpy(data, b->small, (size_t)b->len);
    } else {
        data = PyMem_Realloc(b->data, (size_t)cap);
    }
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0)
        return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

static void buf_init(Buf *b) {
    b->data = b->small;
    b->len = 0;
    b->cap = (Py_ssize_t)sizeof(b->small);
    b->obj = NULL;
    b->pieces = NULL;
}

/* An empty buffer whose output is a list of pieces (see Buf). */
static int buf_chunked(Buf *b) {
    buf_init(b);
    b->pieces = PyList_New(0);
    if (b->pieces == NULL)
        return -1;
    return buf_new_piece(b, CHUNK);
}

static void buf_free(Buf *b) {
    if (b->pieces != NULL) {
        Py_CLEAR(b->obj);
        Py_CLEAR(b->pieces);
        b->data = b->small;
    } else if (b->data != b->small) {
        PyMem_Free(b->data);
    }
}

/* What was written (bytes; chunked: a list of bytes), and the buffer freed. */
static PyObject *buf_finish(Buf *b) {
    if (b->pieces != NULL) {
        if (buf_end_piece(b) < 0) {
            buf_free(b);
            return NULL;
        }
        PyObject *pieces = b->pieces;
        b->pieces = NULL;
        return pieces;
    }
    PyObject *result = PyBytes_FromStringAndSize(b->data, b->len);
    buf_free(b);
    return result;
}

/* Is s[0:n] valid UTF-8 as Python's strict decoder has it (no overlong forms, no surrogates,
 * nothing above U+10FFFF)? */
static int utf8_valid(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80)
                return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n)
                return 0;
            unsigned char c1 = s[i + 1], c2 = s[i + 2];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80)
                return 0;
            if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 >= 0xA0))
                return 0;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n)
                return 0;
            unsigned char c1 = s[i + 1], c2 = s[i + 2], c3 = s[i + 3];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 >= 0x90))
                return 0;
            i += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static const char HEX[] = "0123456789abcdef";

/* A JSON string of s[0:n] (valid UTF-8) as orjson writes it: `"` and `\` escaped, control
 * characters as \b \t \n \f \r or \u00XX, everything else as it is. */
static int put_string(Buf *b, const unsigned char *s, Py_ssize_t n) {
    if (buf_reserve(b, n * 6 + 2) < 0)
        return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *out++ = (char)c;
            continue;
        }
        *out++ = '\\';
        switch (c) {
        case '"': *out++ = '"'; break;
        case '\\': *out++ = '\\'; break;
        case '\b': *out++ = 'b'; break;
        case '\t': *out++ = 't'; break;
        case '\n': *out++ = 'n'; break;
        case '\f': *out++ = 'f'; break;
        case '\r': *out++ = 'r'; break;
        default:
            *out++ = 'u';
            *out++ = '0';
            *out++ = '0';
            *out++ = HEX[c >> 4];
            *out++ = HEX[c & 15];
        }
    }
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

/* Printable ASCII without `"` and `\`: what a JSON string holds unescaped and unchanged. */
static int plain_ascii(const unsigned char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c < 0x20 || c > 0x7E || c == '"' || c == '\\')
            return 0;
    }
    return 1;
}

/* s with its first space replaced by 'T', in quotes (s is plain ASCII). */
static int put_t_form(Buf *b, const char *s, Py_ssize_t n, const char *tail, Py_ssize_t tail_n) {
    if (buf_reserve(b, n + tail_n + 2) < 0)
        return -1;
    char *out = b->data + b->len;
    *out++ = '"';
    memcpy(out, s, (size_t)n);
    char *space = memchr(out, ' ', (size_t)n);
    if (space != NULL)
        *space = 'T';
    out += n;
    memcpy(out, tail, (size_t)tail_n);
    out += tail_n;
    *out++ = '"';
    b->len = out - b->data;
    return 0;
}

/* An integer's text that orjson writes back unchanged for int(text): an optional '-', then 1 to
 * 18 digits without a leading zero (so it fits in 64 bits); "-0" excluded. */
static int canonical_int(const char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    if (n > 0 && s[0] == '-')
        i = 1;
    Py_ssize_t digits = n - i;
    if (digits < 1 || digits > 18)
        return 0;
    if (s[i] == '0' && (digits > 1 || i == 1))
        return 0;
    for (; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

/* A float's text that orjson writes, for float(text), as the same digits in fixed notation:
 * [-]digits[.digits] with no exponent, an integer part of at most 15 digits without a leading
 * zero (so |x| < 1e15), at most 15 significant digits in all (so the text is the shortest form
 * of its double: two decimals of 15 digits or fewer never round to the same double), and, below
 * 1, at most four zeros after the point (orjson switches to an exponent under 1e-5). Written as
 * orjson does: trailing zeros of the fraction dropped, ".0" when nothing is left of it. */
static int put_float(Buf *b, const char *s, Py_ssize_t n) {
    Py_ssize_t i = 0, sign = 0;
    if (n > 0 && s[0] == '-')
        i = sign = 1;
    Py_ssize_t int_start = i;
    while (i < n && s[i] >= '0' && s[i] <= '9')
        i++;
    Py_ssize_t int_len = i - int_start;
    if (int_len < 1 || int_len > 15 || (int_len > 1 && s[int_start] == '0'))
        return 0;
    Py_ssize_t frac_start = n, frac_len = 0;
    if (i < n) {
        if (s[i] != '.')
            return 0;
        frac_start = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i != n || i == frac_start)
            return 0;
        frac_len = n - frac_start;
    }
    while (frac_len > 0 && s[frac_start + frac_len - 1] == '0')
        frac_len--;  /* trailing zeros: not significant, not written */
    int zero_int = int_len == 1 && s[int_start] == '0';
    Py_ssize_t significant = zero_int ? 0 : int_len;
    if (zero_int && frac_len > 0) {
        Py_ssize_t lead = 0;
        while (s[frac_start + lead] == '0')
            lead++;
        if (lead > 4)
            return 0;
        significant = frac_len - lead;
    } else {
        significant += frac_len;
    }
    if (significant > 15)
        return 0;
    if (buf_reserve(b, sign + int_len + 1 + (frac_len ? frac_len : 1)) < 0)
        return -1;
    char *out = b->data + b->len;
    if (sign)
        *out++ = '-';
    memcpy(out, s + int_start, (size_t)int_len);
    out += int_len;
    *out++ = '.';
    if (frac_len) {
        memcpy(out, s + frac_start, (size_t)frac_len);
        out += frac_len;
    } else {
        *out++ = '0';
    }
    b->len = out - b->data;
    return 1;
}

/* The fast path of one text value; 1 written, 0 not applicable (the converter's turn), -1 error. */
static int put_fast(Buf *b, int code, const char *s, Py_ssize_t n) {
    switch (code) {
    case J_INT:
        if (!canonical_int(s, n))
            return 0;
        return buf_put(b, s, n) < 0 ? -1 : 1;
    case J_BOOL:
        if (n == 1 && s[0] == 't')
            return buf_put(b, "true", 4) < 0 ? -1 : 1;
        return buf_put(b, "false", 5) < 0 ? -1 : 1;
    case J_STRING:
        if (!utf8_valid((const unsigned char *)s, n))
            return 0;
        return put_string(b, (const unsigned char *)s, n) < 0 ? -1 : 1;
    case J_TIMESTAMPTZ:
        /* "2024-01-02 03:04:05.5+00" -> "2024-01-02T03:04:05.5Z" */
        if (n < 5 || s[4] != '-' || memcmp(s + n - 3, "+00", 3) != 0
            || !plain_ascii((const unsigned char *)s, n))
            return 0;
        return put_t_form(b, s, n - 3, "Z", 1) < 0 ? -1 : 1;
    case J_TIMESTAMP:
        /* "2024-01-02 03:04:05.5" -> "2024-01-02T03:04:05.5"; infinity and BC as they are */
        if (n < 1 || !plain_ascii((const unsigned char *)s, n))
            return 0;
        if (s[n - 1] == 'C' || s[n - 1] == 'y') {
            if (buf_reserve(b, n + 2) < 0)
                return -1;
            b->data[b->len++] = '"';
            memcpy(b->data + b->len, s, (size_t)n);
            b->len += n;
            b->data[b->len++] = '"';
            return 1;
        }
        return put_t_form(b, s, n, "", 0) < 0 ? -1 : 1;
    case J_FLOAT:
        return put_float(b, s, n);
    default:
        return 0;
    }
}

/* converter(value) serialised by dumps, appended. */
static int put_converted(Buf *b, PyObject *conv, PyObject *value, PyObject *dumps) {
    PyObject *converted = PyObject_CallOneArg(conv, value);
    if (converted == NULL)
        return -1;
    PyObject *json = PyObject_CallOneArg(dumps, converted);
    Py_DECREF(converted);
    if (json == NULL)
        return -1;
    if (!PyBytes_Check(json)) {
        Py_DECREF(json);
        PyErr_SetString(PyExc_TypeError, "row_json: dumps must return bytes");
        return -1;
    }
    int rc = buf_put(b, PyBytes_AS_STRING(json), PyBytes_GET_SIZE(json));
    Py_DECREF(json);
    return rc;
}

PyDoc_STRVAR(row_json_doc,
"row_json(names, idx, codes, text_convs, binary_convs, kinds, values, dumps) -> bytes | None\n\n"
"The JSON object of a row's columns: ``orjson.dumps({name: converter(value)})`` for the columns\n"
"``idx`` (None: all of them, in order), ``names[j]`` being the bytes that come before column\n"
"j's value (``{\"id\":`` then ``,\"qty\":`` ...). ``codes[i]``: column i's fast path\n"
"(cdcd.values.types); ``text_convs``/``binary_convs``: its JSON converters for ``t`` and ``b``\n"
"values. None when a selected column is unchanged TOAST or the tuple has another number of\n"
"columns (the caller's general path handles both); converter errors propagate.");

/* Column j of a selection (`idx`: column indexes, None: all `ncols` in order): its index into
 * *i, and its name (the bytes before its value) written. */
static int put_name(Buf *b, PyObject *names, PyObject *idx, Py_ssize_t j, Py_ssize_t ncols,
                    Py_ssize_t *i) {
    *i = j;
    if (idx != Py_None) {
        *i = PyLong_AsSsize_t(PyTuple_GET_ITEM(idx, j));
        if (*i == -1 && PyErr_Occurred())
            return -1;
        if (*i < 0 || *i >= ncols) {
            PyErr_SetString(PyExc_IndexError, "row_json: column index out of range");
            return -1;
        }
    }
    PyObject *name = PyTuple_GET_ITEM(names, j);
    if (!PyBytes_Check(name)) {
        PyErr_SetString(PyExc_TypeError, "row_json: names must be bytes");
        return -1;
    }
    return buf_put(b, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name));
}

/* A row's JSON object into b: 1 written, 0 the general path must take it (unchanged TOAST
 * among the selected columns, an unknown kind, a tuple of another width; b then holds part of
 * it), -1 an error (set). Arguments as row_json's, types checked by the caller but values. */
static int put_row(Buf *b, PyObject *names, PyObject *idx, PyObject *codes, PyObject *text_convs,
                   PyObject *binary_convs, PyObject *kinds, PyObject *values, PyObject *dumps) {
    if (!PyBytes_Check(kinds) || !PyTuple_Check(values))  /* anything else: general path */
        return 0;
    Py_ssize_t ncols = PyBytes_GET_SIZE(codes);
    if (PyBytes_GET_SIZE(kinds) != ncols || PyTuple_GET_SIZE(values) != ncols
        || PyTuple_GET_SIZE(text_convs) != ncols || PyTuple_GET_SIZE(binary_convs) != ncols)
        return 0;
    Py_ssize_t count = idx == Py_None ? ncols : PyTuple_GET_SIZE(idx);
    if (PyTuple_GET_SIZE(names) != count) {
        PyErr_SetString(PyExc_ValueError, "row_json: one name per selected column");
        return -1;
    }
    const char *kind = PyBytes_AS_STRING(kinds);
    const char *code = PyBytes_AS_STRING(codes);
    /* unchanged TOAST among the selected columns: the caller's general path, before any work */
    if (idx == Py_None) {
        if (memchr(kind, KIND_UNCHANGED, (size_t)ncols) != NULL)
            return 0;
    } else {
        for (Py_ssize_t j = 0; j < count; j++) {
            Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(idx, j));
            if (i >= 0 && i < ncols && kind[i] == KIND_UNCHANGED)
                return 0;
        }
        PyErr_Clear();  /* a bad index is reported below */
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_ssize_t i;
        if (put_name(b, names, idx, j, ncols, &i) < 0)
            return -1;
        if (kind[i] == KIND_UNCHANGED)  /* checked above: not reached */
            return 0;
        PyObject *value = PyTuple_GET_ITEM(values, i);
        int rc = 0;
        if (kind[i] == KIND_NULL) {
            rc = buf_put(b, "null", 4) < 0 ? -1 : 1;
        } else if (kind[i] == KIND_TEXT) {
            if (PyBytes_Check(value))
                rc = put_fast(b, code[i], PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value));
            if (rc == 0)
                rc = put_converted(b, PyTuple_GET_ITEM(text_convs, i), value, dumps) < 0 ? -1 : 1;
        } else if (kind[i] == KIND_BINARY) {
            rc = put_converted(b, PyTuple_GET_ITEM(binary_convs, i), value, dumps) < 0 ? -1 : 1;
        } else {  /* an unknown kind: the general path names it */
            return 0;
        }
        if (rc < 0)
            return -1;
    }
    return buf_put(b, count ? "}" : "{}", count ? 1 : 2) < 0 ? -1 : 1;
}

static int row_args_ok(PyObject *names, PyObject *idx, PyObject *codes, PyObject *text_convs,
                       PyObject *binary_convs) {
    if (!PyTuple_Check(names) || !(idx == Py_None || PyTuple_Check(idx)) || !PyBytes_Check(codes)
        || !PyTuple_Check(text_convs) || !PyTuple_Check(binary_convs)) {
        PyErr_SetString(PyExc_TypeError, "row_json: wrong argument types");
        return 0;
    }
    return 1;
}

static PyObject *row_json(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "row_json takes 8 arguments");
        return NULL;
    }
    PyObject *names = args[0], *idx = args[1], *codes = args[2], *text_convs = args[3];
    PyObject *binary_convs = args[4], *kinds = args[5], *values = args[6], *dumps = args[7];
    if (!row_args_ok(names, idx, codes, text_convs, binary_convs))
        return NULL;
    if (!PyBytes_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError, "row_json: wrong argument types");
        return NULL;
    }
    Buf b;
    buf_init(&b);
    int rc = put_row(&b, names, idx, codes, text_convs, binary_convs, kinds, values, dumps);
    if (rc == 1)
        return buf_finish(&b);
    buf_free(&b);
    if (rc == 0)
        Py_RETURN_NONE;
    return NULL;
}

/* The decimal digits of an int (one that fits in 64 bits, signed or not) plus `add` (0 or 1;
 * the sum of a non-negative int must fit too). */
static int put_int_plus(Buf *b, PyObject *obj, int add) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "event_body: an integer field is not an int");
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    unsigned long long u;
    int negative = 0;
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred())
            return -1;
        negative = v < 0;
        u = negative ? 0ULL - (unsigned long long)v : (unsigned long long)v;
        if (add) {  /* -1 + 1 is 0; otherwise the magnitude moves by one */
            if (negative)
                negative = --u != 0;
            else
                u += 1;  /* at most LLONG_MAX + 1: fits */
        }
    } else {
        u = PyLong_AsUnsignedLongLong(obj);
        if (u == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        if (add && u == (unsigned long long)-1) {
            PyErr_SetString(PyExc_OverflowError, "event_body: integer too large");
            return -1;
        }
        u += (unsigned long long)add;
    }
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (buf_reserve(b, n + 1) < 0)
        return -1;
    char *out = b->data + b->len;
    if (negative)
        *out++ = '-';
    while (n)
        *out++ = digits[--n];
    b->len = out - b->data;
    return 0;
}

static int put_int(Buf *b, PyObject *obj) { return put_int_plus(b, obj, 0); }

#define PUT_LIT(b, s) buf_put((b), (s), (Py_ssize_t)(sizeof(s) - 1))

/* bytes as they are, a str as UTF-8 */
static int put_bytes(Buf *b, PyObject *obj) {
    if (PyBytes_Check(obj))
        return buf_put(b, PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj));
    if (PyUnicode_Check(obj)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(obj, &n);
        return s == NULL ? -1 : buf_put(b, s, n);
    }
    PyErr_SetString(PyExc_TypeError, "event_body: a JSON part is neither bytes nor str");
    return -1;
}

PyDoc_STRVAR(event_body_doc,
"event_body(before, after, source_head, lsn, prev_lsn, commit_lsn, seq, extra, op, ts_ms,\n"
"           txid, dco, key) -> bytes\n\n"
"A row event's JSON without its closing brace, as ChangeEvent._body formats it in Python:\n"
"``{\"before\":<before>,\"after\":<after>,\"source\":<source_head>\"lsn\":...,\"seq\":<seq>"
"<extra>},\"op\":...,\"transaction\":...``. ``before``/``after``/``source_head``/``extra``: JSON\n"
"bytes; ``op``, ``txid``: str written as they are (``txid`` None: a null transaction block);\n"
"``prev_lsn`` None: the first event of its transaction. ``key`` (JSON bytes) given: the whole\n"
"JSON Lines record instead, ``<body>,\"key\":<key>}``.");

static PyObject *event_body(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "event_body takes 13 arguments");
        return NULL;
    }
    PyObject *before = args[0], *after = args[1], *head = args[2], *lsn = args[3];
    PyObject *prev = args[4], *commit_lsn = args[5], *seq = args[6], *extra = args[7];
    PyObject *op = args[8], *ts_ms = args[9], *txid = args[10], *dco = args[11];
    PyObject *key = args[12];
    Buf b;
    buf_init(&b);
    if (PUT_LIT(&b, "{\"before\":") < 0 || put_bytes(&b, before) < 0
        || PUT_LIT(&b, ",\"after\":") < 0 || put_bytes(&b, after) < 0
        || PUT_LIT(&b, ",\"source\":") < 0 || put_bytes(&b, head) < 0
        || PUT_LIT(&b, "\"lsn\":") < 0 || put_int(&b, lsn) < 0
        || PUT_LIT(&b, ",\"sequence\":\"[") < 0)
        goto fail;
    if (prev == Py_None) {
        if (PUT_LIT(&b, "null") < 0)
            goto fail;
    } else if (PUT_LIT(&b, "\\\"") < 0 || put_int(&b, prev) < 0 || PUT_LIT(&b, "\\\"") < 0) {
        goto fail;
    }
    if (PUT_LIT(&b, ",\\\"") < 0 || put_int(&b, lsn) < 0
        || PUT_LIT(&b, "\\\"]\",\"xmin\":null,\"commit_lsn\":") < 0 || put_int(&b, commit_lsn) < 0
        || PUT_LIT(&b, ",\"seq\":") < 0 || put_int(&b, seq) < 0 || put_bytes(&b, extra) < 0
        || PUT_LIT(&b, "},\"op\":\"") < 0 || put_bytes(&b, op) < 0
        || PUT_LIT(&b, "\",\"ts_ms\":") < 0 || put_int(&b, ts_ms) < 0
        || PUT_LIT(&b, ",\"transaction\":") < 0)
        goto fail;
    if (txid == Py_None) {
        if (PUT_LIT(&b, "null") < 0)
            goto fail;
    } else {
        if (PUT_LIT(&b, "{\"id\":\"") < 0 || put_bytes(&b, txid) < 0
            || PUT_LIT(&b, "\",\"total_order\":") < 0 || put_int_plus(&b, seq, 1) < 0
            || PUT_LIT(&b, ",\"data_collection_order\":") < 0 || put_int(&b, dco) < 0
            || PUT_LIT(&b, "}") < 0)
            goto fail;
    }
    if (key != Py_None  /* the JSON Lines record: the key, and the value's closing brace */
        && (PUT_LIT(&b, ",\"key\":") < 0 || put_bytes(&b, key) < 0 || PUT_LIT(&b, "}") < 0))
        goto fail;
    return buf_finish(&b);
fail:
    buf_free(&b);
    return NULL;
}

/* The decimal digits of v. */
static int put_ll(Buf *b, long long v) {
    char digits[24];
    int n = 0;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (buf_reserve(b, n + 1) < 0)
        return -1;
    char *out = b->data + b->len;
    if (v < 0)
        *out++ = '-';
    while (n)
        *out++ = digits[--n];
    b->len = out - b->data;
    return 0;
}

static PyObject *ATTR_KINDS, *ATTR_VALUES;

/* What the records of one batch of snapshot rows share (snapshot_lines' arguments after the
 * first), and the parts of their envelope that are the same for every row (snap_prepare). */
typedef struct {
    PyObject *names, *codes, *text_convs, *binary_convs, *key_idx, *key_names;
    PyObject *head, *last_head, *extra, *dumps;
    Py_ssize_t last_index;
    long long commit_lsn, first_seq, ts_ms;
    /* from the after image's end to the seq's digits: row 0, rows after it, the last row */
    PyObject *env_first, *env_rest, *env_last;
    PyObject *env_tail;  /* from after the seq to the key */
} Snap;

static void snap_clear(Snap *s) {
    Py_CLEAR(s->env_first);
    Py_CLEAR(s->env_rest);
    Py_CLEAR(s->env_last);
    Py_CLEAR(s->env_tail);
}

/* ``,"source":`` head ``"lsn":`` ... ``"seq":`` for a row that is first or not, with `head`. */
static PyObject *snap_env(const Snap *s, PyObject *head, int first) {
    Buf b;
    buf_init(&b);
    if (PUT_LIT(&b, ",\"source\":") < 0 || put_bytes(&b, head) < 0 || PUT_LIT(&b, "\"lsn\":") < 0
        || put_ll(&b, s->commit_lsn) < 0 || PUT_LIT(&b, ",\"sequence\":\"[") < 0)
        goto fail;
    if (first) {
        if (PUT_LIT(&b, "null") < 0)
            goto fail;
    } else if (PUT_LIT(&b, "\\\"") < 0 || put_ll(&b, s->commit_lsn) < 0 || PUT_LIT(&b, "\\\"") < 0) {
        goto fail;
    }
    if (PUT_LIT(&b, ",\\\"") < 0 || put_ll(&b, s->commit_lsn) < 0
        || PUT_LIT(&b, "\\\"]\",\"xmin\":null,\"commit_lsn\":") < 0 || put_ll(&b, s->commit_lsn) < 0
        || PUT_LIT(&b, ",\"seq\":") < 0)
        goto fail;
    return buf_finish(&b);
fail:
    buf_free(&b);
    return NULL;
}

static int snap_prepare(Snap *s) {
    Buf b;
    s->env_first = snap_env(s, s->head, 1);
    s->env_rest = snap_env(s, s->head, 0);
    s->env_last = snap_env(s, s->last_head, s->last_index == 0);
    if (s->env_first == NULL || s->env_rest == NULL || s->env_last == NULL)
        return -1;
    buf_init(&b);
    if (put_bytes(&b, s->extra) < 0 || PUT_LIT(&b, "},\"op\":\"r\",\"ts_ms\":") < 0
        || put_ll(&b, s->ts_ms) < 0
        /* snapshot rows: no transaction block */
        || PUT_LIT(&b, ",\"transaction\":null,\"key\":") < 0) {
        buf_free(&b);
        return -1;
    }
    s->env_tail = buf_finish(&b);
    return s->env_tail == NULL ? -1 : 0;
}

static int snap_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, Snap *s) {
    s->env_first = s->env_rest = s->env_last = s->env_tail = NULL;
    if (nargs != 15) {
        PyErr_Format(PyExc_TypeError, "%s takes 15 arguments", fn);
        return -1;
    }
    s->names = args[1];
    s->codes = args[2];
    s->text_convs = args[3];
    s->binary_convs = args[4];
    s->key_idx = args[5];
    s->key_names = args[6];
    s->head = args[7];
    s->last_head = args[8];
    s->extra = args[13];
    s->dumps = args[14];
    if (!row_args_ok(s->names, Py_None, s->codes, s->text_convs, s->binary_convs)
        || !(s->key_idx == Py_None || (PyTuple_Check(s->key_idx) && PyTuple_Check(s->key_names)))) {
        PyErr_Format(PyExc_TypeError, "%s: wrong argument types", fn);
        return -1;
    }
    s->last_index = PyLong_AsSsize_t(args[9]);
    s->commit_lsn = PyLong_AsLongLong(args[10]);
    s->first_seq = PyLong_AsLongLong(args[11]);
    s->ts_ms = PyLong_AsLongLong(args[12]);
    if (PyErr_Occurred() || snap_prepare(s) < 0) {
        snap_clear(s);
        return -1;
    }
    return 0;
}

/* Row i's record from the after image's end to the key: ``,"source":...,"key":``. */
static int put_envelope(Buf *b, const Snap *s, Py_ssize_t i) {
    PyObject *env = i == s->last_index ? s->env_last : i == 0 ? s->env_first : s->env_rest;
    if (buf_put(b, PyBytes_AS_STRING(env), PyBytes_GET_SIZE(env)) < 0
        || put_ll(b, s->first_seq + i) < 0
        || buf_put(b, PyBytes_AS_STRING(s->env_tail), PyBytes_GET_SIZE(s->env_tail)) < 0)
        return -1;
    return 0;
}

PyDoc_STRVAR(snapshot_lines_doc,
"snapshot_lines(rows, names, codes, text_convs, binary_convs, key_idx, key_names, head,\n"
"               last_head, last_index, commit_lsn, first_seq, ts_ms, extra, dumps)\n"
"    -> list[bytes] | None\n\n"
"The JSON Lines records, each followed by a newline, in pieces of about 64 KiB (a record may\n"
"span two), of the op \"r\" events that\n"
"Encoder.snapshot_run makes of ``rows`` (TupleData of one table): row i has seq\n"
"``first_seq + i``, lsn and commit_lsn ``commit_lsn``, a previous lsn from its second row on,\n"
"the source fields ``head`` (``last_head`` for row ``last_index``; -1: none) then ``extra``\n"
"after seq, no before image and no transaction block; its key from the columns ``key_idx``\n"
"(None: a null key). Joined, the same bytes as the events' record_json(). None when a row needs the\n"
"general path (unchanged TOAST, another width); a converter's error propagates.");

static PyObject *snapshot_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Snap s;
    if (snap_args("snapshot_lines", args, nargs, &s) < 0)
        return NULL;
    PyObject *rows = args[0];
    if (!PyList_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "snapshot_lines: rows must be a list");
        snap_clear(&s);
        return NULL;
    }
    Buf b;
    if (buf_chunked(&b) < 0) {
        buf_free(&b);
        snap_clear(&s);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(rows);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(rows, i);
        PyObject *kinds = PyObject_GetAttr(row, ATTR_KINDS);
        if (kinds == NULL)
            goto fail;
        PyObject *values = PyObject_GetAttr(row, ATTR_VALUES);
        if (values == NULL) {
            Py_DECREF(kinds);
            goto fail;
        }
        int rc = PUT_LIT(&b, "{\"before\":null,\"after\":") < 0 ? -1 : 1;
        if (rc == 1)
            rc = put_row(&b, s.names, Py_None, s.codes, s.text_convs, s.binary_convs, kinds,
                         values, s.dumps);
        if (rc == 1 && put_envelope(&b, &s, i) < 0)
            rc = -1;
        if (rc == 1) {
            if (s.key_idx == Py_None)
                rc = PUT_LIT(&b, "null") < 0 ? -1 : 1;
            else
                rc = put_row(&b, s.key_names, s.key_idx, s.codes, s.text_convs, s.binary_convs,
                             kinds, values, s.dumps);
        }
        if (rc == 1 && PUT_LIT(&b, "}\n") < 0)
            rc = -1;
        Py_DECREF(kinds);
        Py_DECREF(values);
        if (rc < 0)
            goto fail;
        if (rc == 0) {
            buf_free(&b);
            snap_clear(&s);
            Py_RETURN_NONE;
        }
    }
    snap_clear(&s);
    return buf_finish(&b);
fail:
    buf_free(&b);
    snap_clear(&s);
    return NULL;
}

/* --- COPY text -------------------------------------------------------------------------- */

/* One field of a COPY text line: its value's bytes (unescaped), or null. */
typedef struct {
    const char *s;
    Py_ssize_t n;
    int null;
} Field;

/* COPY's escapes as cdcd/decoder/copy_text.py undoes them: \b \f \n \r \t \v \\ become the
 * character, a backslash before any other character becomes that character, a backslash that
 * ends the field stays. */
static char unescaped(char c) {
    switch (c) {
    case 'b': return '\b';
    case 'f': return '\f';
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    case 'v': return '\v';
    default: return c;
    }
}

/* Split a line into `width` fields (0: another number of fields), unescaping into `scratch`
 * (at least `len` bytes: an unescaped field is never longer). */
static int split_line(const char *line, Py_ssize_t len, Py_ssize_t width, Field *fields,
                      char *scratch) {
    Py_ssize_t count = 0;
    const char *p = line, *end = line + len;
    for (;;) {
        const char *tab = memchr(p, '\t', (size_t)(end - p));
        const char *stop = tab == NULL ? end : tab;
        if (count == width)
            return 0;
        Field *f = &fields[count++];
        Py_ssize_t n = stop - p;
        f->null = 0;
        if (memchr(p, '\\', (size_t)n) == NULL) {
            f->s = p;
            f->n = n;
        } else if (n == 2 && p[0] == '\\' && p[1] == 'N') {
            f->null = 1;
            f->s = p;
            f->n = 0;
        } else {
            char *out = scratch;
            for (const char *q = p; q < stop; q++) {
                if (*q == '\\' && q + 1 < stop)
                    *out++ = unescaped(*++q);
                else
                    *out++ = *q;
            }
            f->s = scratch;
            f->n = out - scratch;
            scratch = out;
        }
        if (tab == NULL)
            break;
        p = tab + 1;
    }
    return count == width;
}

/* put_row for COPY fields (text or null). */
static int put_fields(Buf *b, PyObject *names, PyObject *idx, PyObject *codes,
                      PyObject *text_convs, const Field *fields, PyObject *dumps) {
    Py_ssize_t ncols = PyBytes_GET_SIZE(codes);
    const char *code = PyBytes_AS_STRING(codes);
    Py_ssize_t count = idx == Py_None ? ncols : PyTuple_GET_SIZE(idx);
    if (PyTuple_GET_SIZE(names) != count || PyTuple_GET_SIZE(text_convs) != ncols) {
        PyErr_SetString(PyExc_ValueError, "copy_snapshot_lines: one name per selected column");
        return -1;
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_ssize_t i;
        if (put_name(b, names, idx, j, ncols, &i) < 0)
            return -1;
        const Field *f = &fields[i];
        if (f->null) {
            if (buf_put(b, "null", 4) < 0)
                return -1;
            continue;
        }
        int rc = put_fast(b, code[i], f->s, f->n);
        if (rc == 0) {
            PyObject *value = PyBytes_FromStringAndSize(f->s, f->n);
            if (value == NULL)
                return -1;
            rc = put_converted(b, PyTuple_GET_ITEM(text_convs, i), value, dumps) < 0 ? -1 : 1;
            Py_DECREF(value);
        }
        if (rc < 0)
            return -1;
    }
    return buf_put(b, count ? "}" : "{}", count ? 1 : 2) < 0 ? -1 : 1;
}

PyDoc_STRVAR(copy_snapshot_lines_doc,
"copy_snapshot_lines(text, names, codes, ...) -> list[bytes] | None\n\n"
"snapshot_lines of the rows in ``text`` (COPY text output: rows separated by newlines, no\n"
"newline after the last), without making them: the same bytes as\n"
"snapshot_lines(copy_rows(text.split(b'\\n'), len(codes)), ...). None when a line has another\n"
"number of fields (copy_rows names it); a converter's error propagates.");

static PyObject *copy_snapshot_lines(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Snap s;
    if (snap_args("copy_snapshot_lines", args, nargs, &s) < 0)
        return NULL;
    PyObject *text = args[0];
    Py_ssize_t width = PyBytes_GET_SIZE(s.codes);
    if (!PyBytes_Check(text)) {
        PyErr_SetString(PyExc_TypeError, "copy_snapshot_lines: text must be bytes");
        snap_clear(&s);
        return NULL;
    }
    if (width == 0 || PyTuple_GET_SIZE(s.text_convs) != width) {
        snap_clear(&s);
        Py_RETURN_NONE;  /* no columns: the general path */
    }
    const char *p = PyBytes_AS_STRING(text);
    Py_ssize_t size = PyBytes_GET_SIZE(text);
    const char *end = p + size;
    Field *fields = PyMem_Malloc(sizeof(Field) * (size_t)width);
    /* a line's unescaped fields are never longer than the line */
    char *scratch = PyMem_Malloc((size_t)size + 1);
    Buf b;
    if (buf_chunked(&b) < 0 || fields == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0;; i++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl == NULL ? end : nl;
        if (!split_line(p, stop - p, width, fields, scratch))
            goto general;
        int rc = PUT_LIT(&b, "{\"before\":null,\"after\":") < 0 ? -1 : 1;
        if (rc == 1)
            rc = put_fields(&b, s.names, Py_None, s.codes, s.text_convs, fields, s.dumps);
        if (rc == 1 && put_envelope(&b, &s, i) < 0)
            rc = -1;
        if (rc == 1) {
            if (s.key_idx == Py_None)
                rc = PUT_LIT(&b, "null") < 0 ? -1 : 1;
            else
                rc = put_fields(&b, s.key_names, s.key_idx, s.codes, s.text_convs, fields,
                                s.dumps);
        }
        if (rc == 1 && PUT_LIT(&b, "}\n") < 0)
            rc = -1;
        if (rc < 0)
            goto fail;
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    PyMem_Free(fields);
    PyMem_Free(scratch);
    snap_clear(&s);
    return buf_finish(&b);
general:
    PyMem_Free(fields);
    PyMem_Free(scratch);
    buf_free(&b);
    snap_clear(&s);
    Py_RETURN_NONE;
fail:
    PyMem_Free(fields);
    PyMem_Free(scratch);
    buf_free(&b);
    snap_clear(&s);
    return NULL;
}

PyDoc_STRVAR(count_newlines_doc,
"count_newlines(data) -> int\n\n"
"data.count(b'\\n') for bytes or a bytearray, in a loop the compiler vectorises (about four\n"
"times bytes.count here).");

static PyObject *count_newlines(PyObject *self, PyObject *data) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *p = view.buf;
    size_t n = (size_t)view.len, count = 0;
    /* 16 byte-wide counters, emptied before they can overflow */
    while (n >= 255 * 16) {
        unsigned char acc[16] = {0};
        for (size_t j = 0; j < 255 * 16; j += 16)
            for (int k = 0; k < 16; k++)
                acc[k] += p[j + k] == '\n';
        for (int k = 0; k < 16; k++)
            count += acc[k];
        p += 255 * 16;
        n -= 255 * 16;
    }
    for (size_t i = 0; i < n; i++)
        count += p[i] == '\n';
    PyBuffer_Release(&view);
    return PyLong_FromSize_t(count);
}

/* --- Kafka records ------------------------------------------------------------------------ */

PyDoc_STRVAR(kafka_record_doc,
"kafka_record(buffer, pos, limit, delta, count, key, value, head, seq, tail, header_count)\n"
"-> int\n\n"
"Write one Kafka record (message format v2) into the bytearray ``buffer`` at ``pos`` and return\n"
"the position after it, or -1 when ``limit`` is not negative and the record would end past it\n"
"(nothing written). ``buffer`` grows to twice its size, or to what the record needs. Exactly\n"
"what cdcd.sinks.kafka.recordbatch.write_record_python writes: the record's length, attributes\n"
"0, ``delta`` and ``count`` as the timestamp and offset deltas, ``key`` and ``value`` (None:\n"
"length -1), ``header_count``, then the encoded headers ``head``, a ``cdcd.seq`` header with\n"
"``seq`` in decimal unless ``seq`` is negative, and ``tail``; zigzag varints throughout.");

static int zz_size(long long value) {
    unsigned long long v = ((unsigned long long)value << 1) ^ (unsigned long long)(value >> 63);
    int size = 1;
    while (v >= 0x80) {
        v >>= 7;
        size++;
    }
    return size;
}

static char *zz_put(char *p, long long value) {
    unsigned long long v = ((unsigned long long)value << 1) ^ (unsigned long long)(value >> 63);
    while (v >= 0x80) {
        *p++ = (char)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

/* bytes or None: its data and length (-1 for None) */
static int opt_bytes(PyObject *obj, const char *what, const char **data, Py_ssize_t *len) {
    if (obj == Py_None) {
        *data = NULL;
        *len = -1;
        return 0;
    }
    if (!PyBytes_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "kafka_record: %s must be bytes or None, not %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *data = PyBytes_AS_STRING(obj);
    *len = PyBytes_GET_SIZE(obj);
    return 0;
}

static PyObject *kafka_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "kafka_record takes 11 arguments");
        return NULL;
    }
    PyObject *buffer = args[0];
    if (!PyByteArray_Check(buffer)) {
        PyErr_SetString(PyExc_TypeError, "kafka_record: buffer must be a bytearray");
        return NULL;
    }
    long long pos = PyLong_AsLongLong(args[1]);
    long long limit = PyLong_AsLongLong(args[2]);
    long long delta = PyLong_AsLongLong(args[3]);
    long long count = PyLong_AsLongLong(args[4]);
    long long seq = PyLong_AsLongLong(args[8]);
    long long header_count = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    const char *key, *value, *head, *tail;
    Py_ssize_t key_len, value_len, head_len, tail_len;
    if (opt_bytes(args[5], "key", &key, &key_len) < 0 ||
        opt_bytes(args[6], "value", &value, &value_len) < 0 ||
        opt_bytes(args[7], "head", &head, &head_len) < 0 ||
        opt_bytes(args[9], "tail", &tail, &tail_len) < 0)
        return NULL;
    if (head == NULL || tail == NULL) {
        PyErr_SetString(PyExc_TypeError, "kafka_record: head and tail must be bytes");
        return NULL;
    }
    if (pos < 0 || pos > PyByteArray_GET_SIZE(buffer)) {
        PyErr_SetString(PyExc_ValueError, "kafka_record: pos outside the buffer");
        return NULL;
    }
    char digits[24];
    int digits_len = 0;
    if (seq >= 0)
        digits_len = snprintf(digits, sizeof(digits), "%lld", seq);
    long long body = 1 + zz_size(delta) + zz_size(count) + zz_size(key_len) +
                     (key_len > 0 ? key_len : 0) + zz_size(value_len) +
                     (value_len > 0 ? value_len : 0) + zz_size(header_count) + head_len +
                     tail_len;
    if (seq >= 0)
        body += 9 + 1 + digits_len; /* the key with its length, the value's length, the value */
    long long end = pos + zz_size(body) + body;
    if (limit >= 0 && end > limit)
        return PyLong_FromLong(-1);
    Py_ssize_t size = PyByteArray_GET_SIZE(buffer);
    if (end > size) {
        Py_ssize_t grown = 2 * size > end ? 2 * size : (Py_ssize_t)end;
        if (PyByteArray_Resize(buffer, grown) < 0)
            return NULL;
    }
    char *p = PyByteArray_AS_STRING(buffer) + pos;
    p = zz_put(p, body);
    *p++ = 0; /* attributes */
    p = zz_put(p, delta);
    p = zz_put(p, count);
    p = zz_put(p, key_len);
    if (key_len > 0) {
        memcpy(p, key, (size_t)key_len);
        p += key_len;
    }
    p = zz_put(p, value_len);
    if (value_len > 0) {
        memcpy(p, value, (size_t)value_len);
        p += value_len;
    }
    p = zz_put(p, header_count);
    memcpy(p, head, (size_t)head_len);
    p += head_len;
    if (seq >= 0) {
        memcpy(p, "\x10" "cdcd.seq", 9);
        p += 9;
        *p++ = (char)(2 * digits_len); /* a varint below 64: one byte */
        memcpy(p, digits, (size_t)digits_len);
        p += digits_len;
    }
    memcpy(p, tail, (size_t)tail_len);
    p += tail_len;
    return PyLong_FromLongLong((long long)(p - PyByteArray_AS_STRING(buffer)));
}

/* --- Arrow columns ------------------------------------------------------------------------- */

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

/* --- the replication stream's CopyData messages -------------------------------------------- */

PyDoc_STRVAR(xlog_run_doc,
"xlog_run(buf, pos, max_bytes, max_message) -> (items, others, pos)\n\n"
"What ``MessageReader.next_xlog_run`` takes from the bytearray ``buf`` at ``pos``: the complete\n"
"CopyData (``d``) messages in a row, each XLogData as ``(wal_start, wal_end, send_time, data)``\n"
"and any other payload as bytes (its index in ``others``), until ``max_bytes`` of payload were\n"
"taken; and the position after them. It stops, taking nothing more, at a message with another\n"
"tag, an incomplete one, or a length below 4 or above ``max_message`` (the Python path then\n"
"raises for that: cdcd/wire/framing.py).");

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint64_t be64(const unsigned char *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

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

/* --- pgoutput's TupleData ------------------------------------------------------------------ */

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

static PyMethodDef methods[] = {
    {"count_newlines", (PyCFunction)count_newlines, METH_O, count_newlines_doc},
    {"row_json", (PyCFunction)(void (*)(void))row_json, METH_FASTCALL, row_json_doc},
    {"event_body", (PyCFunction)(void (*)(void))event_body, METH_FASTCALL, event_body_doc},
    {"snapshot_lines", (PyCFunction)(void (*)(void))snapshot_lines, METH_FASTCALL,
     snapshot_lines_doc},
    {"copy_snapshot_lines", (PyCFunction)(void (*)(void))copy_snapshot_lines, METH_FASTCALL,
     copy_snapshot_lines_doc},
    {"kafka_record", (PyCFunction)(void (*)(void))kafka_record, METH_FASTCALL, kafka_record_doc},
    {"arrow_columns", (PyCFunction)(void (*)(void))arrow_columns, METH_FASTCALL,
     arrow_columns_doc},
    {"xlog_run", (PyCFunction)(void (*)(void))xlog_run, METH_FASTCALL, xlog_run_doc},
    {"parse_tuple", (PyCFunction)(void (*)(void))parse_tuple, METH_FASTCALL, parse_tuple_doc},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot slots[] = {
    {0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "cdcd._rowjson",
    "A row's JSON straight from pgoutput's column bytes (see cdcd/_rowjson.c).", 0, methods,
    slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rowjson(void) {
    if (ATTR_KINDS == NULL && (ATTR_KINDS = PyUnicode_InternFromString("kinds")) == NULL)
        return NULL;
    if (ATTR_VALUES == NULL && (ATTR_VALUES = PyUnicode_InternFromString("values")) == NULL)
        return NULL;
    return PyModuleDef_Init(&moduledef);
}
