/* cdcd._kafkarec: a Kafka record written into a record batch's buffer.
 *
 * kafka_record writes exactly what cdcd.sinks.kafka.recordbatch.write_record_python writes
 * (tests/unit/test_kafka_recordbatch.py compares the two byte for byte).
 *
 * docs/development.md says how it is built and when it is used (C_MODULES in cdcd/_purepy.py).
 */
#include "_cdcd.h"

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

CDCD_ONE_FUNCTION_MODULE(_kafkarec, kafka_record, "A Kafka record written into a record batch's buffer (see cdcd/_kafkarec.c).")
