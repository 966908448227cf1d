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
 * For the initial snapshot it writes a batch's records in one call (snapshot_lines, from rows;
 * copy_snapshot_lines, from COPY's text), and count_newlines counts COPY's rows.
 *
 * The envelope around the rows (event_body, snapshot_lines) is not written here: its field names,
 * punctuation and order are cdcd/events/envelope.py's, whose constant pieces every call is handed
 * (`pieces`, envelope.ROW) and splices in order with the per-event numbers and JSON. The other jobs
 * in C are modules of their own (_kafkarec.c, _arrowcols.c, _xlog.c, _tupledata.c), sharing
 * _cdcd.h.
 *
 * docs/development.md says how it is built and when it is used (cdcd/_purepy.py,
 * C_MODULES: setup.py builds it beside the mypyc modules, with the same build record).
 */
#include "_cdcd.h"

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

/* The envelope's constant pieces (cdcd.events.envelope.RowPieces, in its order): nothing of the
 * envelope is written here but the bytes handed in; these name their places in the tuple. */
enum {
    P_BEFORE, P_AFTER, P_HEAD, P_LSN, P_PREV_NONE, P_PREV, P_PREV_LSN, P_COMMIT_LSN, P_SEQ, P_OP,
    P_TS_MS, P_TXN_NONE, P_TXID, P_TOTAL_ORDER, P_DCO, P_TXN_END, P_KEY, P_END, N_PIECES
};

static int pieces_ok(PyObject *pieces, const char *fn) {
    if (!PyTuple_Check(pieces) || PyTuple_GET_SIZE(pieces) != N_PIECES)
        goto bad;
    for (Py_ssize_t i = 0; i < N_PIECES; i++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(pieces, i)))
            goto bad;
    return 1;
bad:
    PyErr_Format(PyExc_TypeError, "%s: the envelope's pieces must be %d bytes", fn, N_PIECES);
    return 0;
}

static int put_piece(Buf *b, PyObject *pieces, int i) {
    PyObject *piece = PyTuple_GET_ITEM(pieces, i);
    return buf_put(b, PyBytes_AS_STRING(piece), PyBytes_GET_SIZE(piece));
}

PyDoc_STRVAR(event_body_doc,
"event_body(before, after, source_head, lsn, prev_lsn, commit_lsn, seq, extra, op, ts_ms,\n"
"           txid, dco, key, pieces) -> bytes\n\n"
"A row event's JSON without its closing brace, as ChangeEvent._body formats it in Python:\n"
"``pieces`` (cdcd.events.envelope.ROW) are the envelope's constant bytes, spliced in order,\n"
"``{\"before\":<before>,\"after\":<after>,\"source\":<source_head>\"lsn\":...,\"seq\":<seq>"
"<extra>},\"op\":...,\"transaction\":...``. ``before``/``after``/``source_head``/``extra``: JSON\n"
"bytes; ``op``, ``txid``: str written as they are (``txid`` None: a null transaction block);\n"
"``prev_lsn`` None: the first event of its transaction. ``key`` (JSON bytes) given: the whole\n"
"JSON Lines record instead, ``<body>,\"key\":<key>}``.");

static PyObject *event_body(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "event_body takes 14 arguments");
        return NULL;
    }
    PyObject *before = args[0], *after = args[1], *head = args[2], *lsn = args[3];
    PyObject *prev = args[4], *commit_lsn = args[5], *seq = args[6], *extra = args[7];
    PyObject *op = args[8], *ts_ms = args[9], *txid = args[10], *dco = args[11];
    PyObject *key = args[12], *pieces = args[13];
    if (!pieces_ok(pieces, "event_body"))
        return NULL;
    Buf b;
    buf_init(&b);
    if (put_piece(&b, pieces, P_BEFORE) < 0 || put_bytes(&b, before) < 0
        || put_piece(&b, pieces, P_AFTER) < 0 || put_bytes(&b, after) < 0
        || put_piece(&b, pieces, P_HEAD) < 0 || put_bytes(&b, head) < 0
        || put_piece(&b, pieces, P_LSN) < 0 || put_int(&b, lsn) < 0)
        goto fail;
    if (prev == Py_None) {
        if (put_piece(&b, pieces, P_PREV_NONE) < 0)
            goto fail;
    } else if (put_piece(&b, pieces, P_PREV) < 0 || put_int(&b, prev) < 0
               || put_piece(&b, pieces, P_PREV_LSN) < 0) {
        goto fail;
    }
    if (put_int(&b, lsn) < 0 || put_piece(&b, pieces, P_COMMIT_LSN) < 0
        || put_int(&b, commit_lsn) < 0 || put_piece(&b, pieces, P_SEQ) < 0
        || put_int(&b, seq) < 0 || put_bytes(&b, extra) < 0
        || put_piece(&b, pieces, P_OP) < 0 || put_bytes(&b, op) < 0
        || put_piece(&b, pieces, P_TS_MS) < 0 || put_int(&b, ts_ms) < 0)
        goto fail;
    if (txid == Py_None) {
        if (put_piece(&b, pieces, P_TXN_NONE) < 0)
            goto fail;
    } else if (put_piece(&b, pieces, P_TXID) < 0 || put_bytes(&b, txid) < 0
               || put_piece(&b, pieces, P_TOTAL_ORDER) < 0 || put_int_plus(&b, seq, 1) < 0
               || put_piece(&b, pieces, P_DCO) < 0 || put_int(&b, dco) < 0
               || put_piece(&b, pieces, P_TXN_END) < 0) {
        goto fail;
    }
    if (key != Py_None  /* the JSON Lines record: the key, and the value's closing brace */
        && (put_piece(&b, pieces, P_KEY) < 0 || put_bytes(&b, key) < 0
            || put_piece(&b, pieces, P_END) < 0))
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
    PyObject *head, *last_head, *extra, *dumps, *pieces;
    Py_ssize_t last_index;
    long long commit_lsn, first_seq, ts_ms;
    /* from the after image's end to the seq's digits: row 0, rows after it, the last row */
    PyObject *env_first, *env_rest, *env_last;
    PyObject *env_tail;  /* from after the seq to the key */
    PyObject *env_start, *env_end;  /* a row's record up to its after image; after its key */
} Snap;

static void snap_clear(Snap *s) {
    Py_CLEAR(s->env_first);
    Py_CLEAR(s->env_rest);
    Py_CLEAR(s->env_last);
    Py_CLEAR(s->env_tail);
    Py_CLEAR(s->env_start);
    Py_CLEAR(s->env_end);
}

/* ``,"source":`` head ``"lsn":`` ... ``"seq":`` for a row that is first or not, with `head`. */
static PyObject *snap_env(const Snap *s, PyObject *head, int first) {
    Buf b;
    buf_init(&b);
    if (put_piece(&b, s->pieces, P_HEAD) < 0 || put_bytes(&b, head) < 0
        || put_piece(&b, s->pieces, P_LSN) < 0 || put_ll(&b, s->commit_lsn) < 0)
        goto fail;
    if (first) {
        if (put_piece(&b, s->pieces, P_PREV_NONE) < 0)
            goto fail;
    } else if (put_piece(&b, s->pieces, P_PREV) < 0 || put_ll(&b, s->commit_lsn) < 0
               || put_piece(&b, s->pieces, P_PREV_LSN) < 0) {
        goto fail;
    }
    if (put_ll(&b, s->commit_lsn) < 0 || put_piece(&b, s->pieces, P_COMMIT_LSN) < 0
        || put_ll(&b, s->commit_lsn) < 0 || put_piece(&b, s->pieces, P_SEQ) < 0)
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
    if (put_bytes(&b, s->extra) < 0 || put_piece(&b, s->pieces, P_OP) < 0
        || PUT_LIT(&b, "r") < 0 || put_piece(&b, s->pieces, P_TS_MS) < 0
        || put_ll(&b, s->ts_ms) < 0
        /* snapshot rows: no transaction block */
        || put_piece(&b, s->pieces, P_TXN_NONE) < 0 || put_piece(&b, s->pieces, P_KEY) < 0) {
        buf_free(&b);
        return -1;
    }
    s->env_tail = buf_finish(&b);
    if (s->env_tail == NULL)
        return -1;
    /* a row's start (no before image) and end (after its key) */
    buf_init(&b);
    if (put_piece(&b, s->pieces, P_BEFORE) < 0 || PUT_LIT(&b, "null") < 0
        || put_piece(&b, s->pieces, P_AFTER) < 0) {
        buf_free(&b);
        return -1;
    }
    s->env_start = buf_finish(&b);
    buf_init(&b);
    if (put_piece(&b, s->pieces, P_END) < 0 || PUT_LIT(&b, "\n") < 0) {
        buf_free(&b);
        return -1;
    }
    s->env_end = buf_finish(&b);
    return s->env_start == NULL || s->env_end == NULL ? -1 : 0;
}

static int snap_args(const char *fn, PyObject *const *args, Py_ssize_t nargs, Snap *s) {
    s->env_first = s->env_rest = s->env_last = s->env_tail = s->env_start = s->env_end = NULL;
    if (nargs != 16) {
        PyErr_Format(PyExc_TypeError, "%s takes 16 arguments", fn);
        return -1;
    }
    s->pieces = args[15];
    if (!pieces_ok(s->pieces, fn))
        return -1;
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

/* bytes made by snap_prepare, appended */
static int put_obj(Buf *b, PyObject *bytes) {
    return buf_put(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
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
"               last_head, last_index, commit_lsn, first_seq, ts_ms, extra, dumps, pieces)\n"
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
        int rc = put_obj(&b, s.env_start) < 0 ? -1 : 1;
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
        if (rc == 1 && put_obj(&b, s.env_end) < 0)
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

/* The field from `p` to `stop` into `f`: as it is, null (\N), or unescaped into `*scratch`
 * (which moves past it). Whether it had a backslash. */
static int field_at(Field *f, const char *p, const char *stop, char **scratch) {
    Py_ssize_t n = stop - p;
    f->null = 0;
    if (memchr(p, '\\', (size_t)n) == NULL) {
        f->s = p;
        f->n = n;
        return 0;
    }
    if (n == 2 && p[0] == '\\' && p[1] == 'N') {
        f->null = 1;
        f->s = p;
        f->n = 0;
        return 1;
    }
    char *out = *scratch;
    for (const char *q = p; q < stop; q++) {
        if (*q == '\\' && q + 1 < stop)
            *out++ = unescaped(*++q);
        else
            *out++ = *q;
    }
    f->s = *scratch;
    f->n = out - *scratch;
    *scratch = out;
    return 1;
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
        field_at(&fields[count++], p, stop, &scratch);
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
        int rc = put_obj(&b, s.env_start) < 0 ? -1 : 1;
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
        if (rc == 1 && put_obj(&b, s.env_end) < 0)
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

/* ---- copy_kept: the rows of a COPY batch whose key a watermark window did not see change ---- */

/* A filter of the changed keys' hashes, so that a line whose key is not among them is kept
 * without making its key as Python objects; a hit is checked against the set itself. */
#define KEPT_BITS_MIN 64
#define FNV_BASIS 14695981039346656037ULL
#define FNV_PRIME 1099511628211ULL

static uint64_t kept_hash_add(uint64_t h, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= FNV_PRIME;
    }
    h ^= (uint64_t)n; /* the field's end: ("ab", "c") and ("a", "bc") differ */
    return h * FNV_PRIME;
}

typedef struct {
    unsigned char *bits;
    uint64_t mask;
    int all; /* a key the filter cannot hold: every line is looked up */
} KeptFilter;

static int kept_filter(KeptFilter *f, PyObject *changed, Py_ssize_t nkey) {
    Py_ssize_t n = PySet_GET_SIZE(changed);
    uint64_t size = KEPT_BITS_MIN;
    while (size < (uint64_t)n * 8)
        size <<= 1;
    f->mask = size - 1;
    f->all = 0;
    f->bits = PyMem_Calloc((size_t)(size / 8), 1);
    if (f->bits == NULL)
        return -1;
    PyObject *it = PyObject_GetIter(changed), *key;
    if (it == NULL)
        return -1;
    while ((key = PyIter_Next(it)) != NULL) {
        if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != nkey) {
            f->all = 1; /* no line's key is such a thing, but the set decides */
        } else {
            uint64_t h = FNV_BASIS;
            int usable = 1;
            for (Py_ssize_t k = 0; k < nkey; k++) {
                PyObject *v = PyTuple_GET_ITEM(key, k);
                if (v == Py_None) {
                    usable = 0; /* a line with a null key field has no key: never matches */
                    break;
                }
                if (!PyBytes_CheckExact(v)) {
                    f->all = 1;
                    usable = 0;
                    break;
                }
                h = kept_hash_add(h, PyBytes_AS_STRING(v), PyBytes_GET_SIZE(v));
            }
            if (usable)
                f->bits[(h & f->mask) >> 3] |= (unsigned char)(1u << (h & 7));
        }
        Py_DECREF(key);
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

PyDoc_STRVAR(copy_kept_doc,
"copy_kept(text, width, positions, changed) -> tuple[bytes, int] | None\n\n"
"The lines of ``text`` (COPY text output of rows of ``width`` columns, separated by\n"
"newlines) whose key, the fields at ``positions`` unescaped as copy_rows does, the set\n"
"``changed`` does not hold (a key with a null field is never held), joined by newlines\n"
"(``text`` itself when every line is kept), and how many. None when a line has too few\n"
"fields, or another number than ``width`` with a backslash in its key: the pure-Python\n"
"twin cdcd.snapshot.watermarks.kept_lines then says why. The same result as that twin.");

static PyObject *copy_kept(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_kept: text, width, positions, changed");
        return NULL;
    }
    PyObject *text = args[0], *positions = args[2], *changed = args[3];
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    if (!PyBytes_Check(text) || !PyTuple_Check(positions) || !PyAnySet_Check(changed)) {
        PyErr_SetString(PyExc_TypeError, "copy_kept: bytes, int, tuple, set");
        return NULL;
    }
    Py_ssize_t nkey = PyTuple_GET_SIZE(positions), need = 0;
    if (nkey == 0 || nkey > 64) {
        PyErr_SetString(PyExc_ValueError, "copy_kept: 1 to 64 key positions");
        return NULL;
    }
    Py_ssize_t pos[64];
    for (Py_ssize_t k = 0; k < nkey; k++) {
        pos[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(positions, k));
        if (pos[k] == -1 && PyErr_Occurred())
            return NULL;
        if (pos[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "copy_kept: a negative key position");
            return NULL;
        }
        if (pos[k] + 1 > need)
            need = pos[k] + 1;
    }
    const char *start = PyBytes_AS_STRING(text), *p = start;
    Py_ssize_t size = PyBytes_GET_SIZE(text);
    const char *end = p + size;
    KeptFilter filter = {NULL, 0, 0};
    Field *fields = PyMem_Malloc(sizeof(Field) * (size_t)need);
    char *escapes = PyMem_Malloc((size_t)need); /* whether each field had a backslash */
    char *scratch = PyMem_Malloc((size_t)size + 1); /* unescaped fields: never longer */
    PyObject *out = NULL, *result = NULL;
    char *w = NULL;
    Py_ssize_t kept = 0;
    if (fields == NULL || escapes == NULL || scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (kept_filter(&filter, changed, nkey) < 0)
        goto done;
    for (;;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *stop = nl == NULL ? end : nl;
        /* the first `need` fields */
        const char *q = p;
        char *sc = scratch;
        for (Py_ssize_t j = 0; j < need; j++) {
            if (j > 0) {
                if (q >= stop) { /* too few fields */
                    result = Py_None;
                    Py_INCREF(result);
                    goto done;
                }
                q++; /* the tab */
            }
            const char *tab = memchr(q, '\t', (size_t)(stop - q));
            const char *fend = tab == NULL ? stop : tab;
            escapes[j] = (char)field_at(&fields[j], q, fend, &sc);
            q = fend;
        }
        int drop = 0, null = 0, escaped = 0;
        for (Py_ssize_t k = 0; k < nkey; k++) {
            null |= fields[pos[k]].null;
            /* a backslash in the key (\N too): the twin parses the row whole (copy_rows),
             * which checks its width */
            escaped |= escapes[pos[k]];
        }
        if (escaped) {
            Py_ssize_t count = 1;
            for (const char *c = p; (c = memchr(c, '\t', (size_t)(stop - c))) != NULL; c++)
                count++;
            if (count != width) {
                result = Py_None;
                Py_INCREF(result);
                goto done;
            }
        }
        if (!null) {
            uint64_t h = FNV_BASIS;
            for (Py_ssize_t k = 0; k < nkey; k++)
                h = kept_hash_add(h, fields[pos[k]].s, fields[pos[k]].n);
            if (filter.all || (filter.bits[(h & filter.mask) >> 3] >> (h & 7)) & 1) {
                PyObject *key = PyTuple_New(nkey);
                if (key == NULL)
                    goto done;
                for (Py_ssize_t k = 0; k < nkey; k++) {
                    PyObject *v = PyBytes_FromStringAndSize(fields[pos[k]].s, fields[pos[k]].n);
                    if (v == NULL) {
                        Py_DECREF(key);
                        goto done;
                    }
                    PyTuple_SET_ITEM(key, k, v);
                }
                int found = PySet_Contains(changed, key);
                Py_DECREF(key);
                if (found < 0)
                    goto done;
                drop = found;
            }
        }
        if (drop) {
            if (out == NULL) { /* the first dropped line: the lines before it, as they are */
                out = PyBytes_FromStringAndSize(NULL, size);
                if (out == NULL)
                    goto done;
                w = PyBytes_AS_STRING(out);
                if (p > start) {
                    memcpy(w, start, (size_t)(p - start - 1));
                    w += p - start - 1;
                }
            }
        } else {
            if (out != NULL) {
                if (kept > 0)
                    *w++ = '\n';
                memcpy(w, p, (size_t)(stop - p));
                w += stop - p;
            }
            kept++;
        }
        if (nl == NULL)
            break;
        p = nl + 1;
    }
    if (out == NULL) {
        result = Py_BuildValue("(On)", text, kept);
    } else {
        if (_PyBytes_Resize(&out, w - PyBytes_AS_STRING(out)) < 0)
            goto done; /* out is freed */
        result = Py_BuildValue("(On)", out, kept);
    }
done:
    Py_XDECREF(out);
    PyMem_Free(filter.bits);
    PyMem_Free(escapes);
    PyMem_Free(fields);
    PyMem_Free(scratch);
    return result;
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

static PyMethodDef methods[] = {
    {"count_newlines", (PyCFunction)count_newlines, METH_O, count_newlines_doc},
    {"row_json", (PyCFunction)(void (*)(void))row_json, METH_FASTCALL, row_json_doc},
    {"event_body", (PyCFunction)(void (*)(void))event_body, METH_FASTCALL, event_body_doc},
    {"snapshot_lines", (PyCFunction)(void (*)(void))snapshot_lines, METH_FASTCALL,
     snapshot_lines_doc},
    {"copy_snapshot_lines", (PyCFunction)(void (*)(void))copy_snapshot_lines, METH_FASTCALL,
     copy_snapshot_lines_doc},
    {"copy_kept", (PyCFunction)(void (*)(void))copy_kept, METH_FASTCALL, copy_kept_doc},
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
