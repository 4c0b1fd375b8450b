/* Kineto events (one JSON array) -> the typed columns parse._Builder keeps, in C.
 *
 * Why: the msgspec path makes one Python object per event and per field and then pulls
 * the columns out of them; that is most of the load time of a large trace. Here yyjson
 * (vendored, vendor/yyjson) parses a chunk and one pass over its events fills the
 * columns directly, with the strings of each column interned per chunk, so Python work
 * is per distinct value, not per event.
 *
 * Contract: scan(buffer) returns the chunk's columns, or None whenever the chunk holds
 * anything this code does not read exactly as the msgspec path does (malformed JSON, an
 * event that is not an object, a number where text belongs, a string where a number
 * belongs, ...). On None the caller decodes the chunk with msgspec, so errors, offsets
 * and odd traces keep that path's behaviour; this is only ever a faster route to the
 * same columns (tests/test_scan.py compares the two on every shared trace).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "yyjson.h"

#if defined(__unix__) || defined(__APPLE__)
#define SCAN_HAS_PREAD 1 /* scan_file: POSIX pread */
#endif

/* -- interning: distinct JSON values of one column, in first-seen order -------------- */

typedef struct {
    int32_t code;   /* index into values, -1: an empty slot */
    uint32_t check; /* the value's hash >> 32: most slots of other values are passed by it alone */
} Slot;

typedef struct {
    yyjson_val **values; /* distinct values, first-seen order */
    Py_ssize_t count, cap;
    Slot *slots; /* open addressing: index into values (-1 empty) and its hash's high half */
    uint64_t *hashes;
    Py_ssize_t nslots;
    int32_t last; /* the code found last: neighbouring events often share a value */
} Interner;

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    return h;
}

/* Eight bytes at a time, then the tail; murmur3's finalizer spreads them to the low bits
 * the slot mask keeps. */
static uint64_t hash_bytes(uint64_t h, const char *s, size_t n) {
    h ^= n * 0x9e3779b97f4a7c15ULL;
    for (; n >= 8; s += 8, n -= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdULL;
        h ^= h >> 32;
    }
    uint64_t tail = 0;
    for (size_t i = 0; i < n; i++) tail |= (uint64_t)(unsigned char)s[i] << (8 * i);
    h = (h ^ tail) * 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 33);
}

/* Eight bytes at a time, then the tail (short strings compare faster so than through a
 * call to memcmp; operator names and shapes are mostly 8-40 bytes). */
static inline int same_bytes(const char *a, const char *b, size_t n) {
    for (; n >= 8; a += 8, b += 8, n -= 8) {
        uint64_t x, y;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y) return 0;
    }
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

static inline int same_string(yyjson_val *a, yyjson_val *b) {
    return (yyjson_get_tag(a) & 0xff) == (yyjson_get_tag(b) & 0xff) && yyjson_get_len(a) == yyjson_get_len(b) &&
           same_bytes(yyjson_get_str(a), yyjson_get_str(b), yyjson_get_len(a));
}

/* Whether b is a string or a number and a is the same one (same_value's test of those,
 * cheaper: neighbouring events often share their pid, tid, phase or category). */
static inline int same_scalar(yyjson_val *a, yyjson_val *b) {
    if (yyjson_is_str(b)) return same_string(a, b);
    return yyjson_is_num(b) && (yyjson_get_tag(a) & 0xff) == (yyjson_get_tag(b) & 0xff) && a->uni.u64 == b->uni.u64;
}

/* Values nested deeper than this are left to the msgspec path (which keeps them as text):
 * the hashing and comparing below recurse, and their depth must be bounded. */
#define MAX_DEPTH 64
#define TOO_DEEP 0 /* hash_value's answer for a value nested deeper than MAX_DEPTH */

/* The bytes of a string or of a raw number (a number beyond 64 bits, kept as its text by
 * YYJSON_READ_BIGNUM_AS_RAW; yyjson_get_str() is NULL for those). */
static inline const char *text_of(yyjson_val *v) { return unsafe_yyjson_get_str(v); }

/* The hash of v; TOO_DEEP (never a real hash: see below) when it nests too deep. */
static uint64_t hash_value(yyjson_val *v, int depth) {
    uint64_t h = mix(0xcbf29ce484222325ULL, yyjson_get_tag(v) & 0xff);
    if (depth > MAX_DEPTH) return TOO_DEEP;
    switch (yyjson_get_type(v)) {
        case YYJSON_TYPE_STR:
        case YYJSON_TYPE_RAW: /* a number beyond 64 bits, as text */
            h = hash_bytes(h, text_of(v), yyjson_get_len(v));
            break;
        case YYJSON_TYPE_NUM:
            h = mix(h, v->uni.u64);
            break;
        case YYJSON_TYPE_ARR: {
            size_t i, max;
            yyjson_val *item;
            yyjson_arr_foreach(v, i, max, item) {
                uint64_t inner = hash_value(item, depth + 1);
                if (inner == TOO_DEEP) return TOO_DEEP;
                h = mix(h, inner);
            }
            break;
        }
        case YYJSON_TYPE_OBJ: {
            size_t i, max;
            yyjson_val *key, *item;
            yyjson_obj_foreach(v, i, max, key, item) {
                uint64_t inner = hash_value(item, depth + 1);
                if (inner == TOO_DEEP) return TOO_DEEP;
                h = mix(h, hash_value(key, depth + 1));
                h = mix(h, inner);
            }
            break;
        }
        default:
            break;
    }
    return h == TOO_DEEP ? 1 : h;
}

/* Same JSON value, same spelling of its numbers (1 and 1.0 stay apart; Python merges them).
 * One pass over the two values' nodes: a document holds a container's values right after
 * it, in order, and its uni.ofs is the bytes up to its next sibling; two values are equal
 * where node after node has the same type, length (or size), span (containers), number
 * bits or bytes (strings, raw numbers). The first node's span checked equal, b is read no
 * further than its own end. */
static int same_value(yyjson_val *a, yyjson_val *b) {
    yyjson_val *end = unsafe_yyjson_get_next(a);
    for (; a < end; a++, b++) {
        uint64_t ta = yyjson_get_tag(a), tb = yyjson_get_tag(b);
        if ((ta & 0xff) != (tb & 0xff)) return 0;
        switch (ta & YYJSON_TYPE_MASK) {
            case YYJSON_TYPE_STR:
            case YYJSON_TYPE_RAW:
                if (yyjson_get_len(a) != yyjson_get_len(b) || !same_bytes(text_of(a), text_of(b), yyjson_get_len(a)))
                    return 0;
                break;
            case YYJSON_TYPE_NUM:
                if (a->uni.u64 != b->uni.u64) return 0;
                break;
            case YYJSON_TYPE_ARR:
            case YYJSON_TYPE_OBJ:
                if ((ta >> YYJSON_TAG_BIT) != (tb >> YYJSON_TAG_BIT) || a->uni.ofs != b->uni.ofs) return 0;
                break;
            default:
                break; /* null, true, false: the tag says it all */
        }
    }
    return 1;
}

static int interner_init(Interner *t) {
    t->count = 0;
    t->cap = 64;
    t->nslots = 128;
    t->last = -1;
    t->values = malloc(sizeof(yyjson_val *) * t->cap);
    t->slots = malloc(sizeof(Slot) * t->nslots);
    t->hashes = malloc(sizeof(uint64_t) * t->cap);
    if (!t->values || !t->slots || !t->hashes) return -1;
    memset(t->slots, 0xff, sizeof(Slot) * t->nslots);
    return 0;
}

static void interner_free(Interner *t) {
    free(t->values);
    free(t->slots);
    free(t->hashes);
}

static int interner_grow(Interner *t) {
    Py_ssize_t nslots = t->nslots * 2;
    Slot *slots = malloc(sizeof(Slot) * nslots);
    if (!slots) return -1;
    memset(slots, 0xff, sizeof(Slot) * nslots);
    for (Py_ssize_t i = 0; i < t->count; i++) {
        Py_ssize_t s = (Py_ssize_t)(t->hashes[i] & (uint64_t)(nslots - 1));
        while (slots[s].code >= 0) s = (s + 1) & (nslots - 1);
        slots[s] = (Slot){(int32_t)i, (uint32_t)(t->hashes[i] >> 32)};
    }
    free(t->slots);
    t->slots = slots;
    t->nslots = nslots;
    return 0;
}

/* The code of v (-1 on allocation failure or a value nested too deep; the caller bails). */
static int32_t intern(Interner *t, yyjson_val *v) {
    if (t->last >= 0 && same_scalar(t->values[t->last], v)) return t->last;
    uint64_t h = hash_value(v, 0);
    if (h == TOO_DEEP) return -1;
    Py_ssize_t s = (Py_ssize_t)(h & (uint64_t)(t->nslots - 1));
    uint32_t check = (uint32_t)(h >> 32);
    while (t->slots[s].code >= 0) {
        int32_t i = t->slots[s].code;
        if (t->slots[s].check == check && t->hashes[i] == h &&
            (yyjson_is_str(v) ? same_string(t->values[i], v) : same_value(t->values[i], v)))
            return t->last = i;
        s = (s + 1) & (t->nslots - 1);
    }
    if (t->count == t->cap) {
        Py_ssize_t cap = t->cap * 2;
        yyjson_val **values = realloc(t->values, sizeof(yyjson_val *) * cap);
        if (!values) return -1;
        t->values = values;
        uint64_t *hashes = realloc(t->hashes, sizeof(uint64_t) * cap);
        if (!hashes) return -1;
        t->hashes = hashes;
        t->cap = cap;
    }
    int32_t code = (int32_t)t->count++;
    t->values[code] = v;
    t->hashes[code] = h;
    t->slots[s] = (Slot){code, check};
    if (t->count * 2 > t->nslots && interner_grow(t) < 0) return -1;
    return t->last = code;
}

/* -- the columns ----------------------------------------------------------------------- */

/* Text columns of timed events, in parse._Builder's order: ph, cat, name, pid, tid, then
 * _ARG_STRINGS (collective, pg_name, dtype, call_stack, kernel_file): interned as decoded values. */
enum { S_PH, S_CAT, S_NAME, S_PID, S_TID, S_COLLECTIVE, S_PG_NAME, S_DTYPE, S_CALL_STACK, S_KERNEL_FILE, N_TEXT };
/* parse._ARG_RAW: interned as JSON text. */
enum { R_INPUT_DIMS, R_INPUT_TYPE, R_CONCRETE, R_GRID, R_BLOCK, R_PG_RANKS, N_RAW };
/* parse._ARG_COLUMNS, in order; only A_FLOPS is floating. */
enum {
    A_EXTERNAL_ID, A_CORRELATION, A_DEVICE, A_STREAM, A_RF_ID, A_SEQ, A_FWD_TID, A_PYTHON_ID,
    A_PYTHON_PARENT_ID, A_BYTES, A_MEM_BYTES, A_TOTAL_ALLOCATED, A_TOTAL_RESERVED, A_DEVICE_ID,
    A_DEVICE_TYPE, A_ADDR, A_FLOPS, A_GROUP_SIZE, A_IN_NELEMS, A_OUT_NELEMS, N_NUMBERS
};
/* args keys beyond the number columns */
enum {
    K_EXTERNAL_ID_OLD = N_NUMBERS, K_COLLECTIVE, K_PG_NAME, K_DTYPE, K_INPUT_DIMS, K_INPUT_TYPE,
    K_CONCRETE, K_GRID, K_BLOCK, K_PG_RANKS, K_META_NAME, K_LABELS, K_CALL_STACK, K_KERNEL_FILE, N_ARG_KEYS
};

typedef struct {
    const char *key;
    int slot;
} Key;

static const Key ARG_KEYS[] = {
    {"External id", A_EXTERNAL_ID}, {"correlation", A_CORRELATION}, {"device", A_DEVICE},
    {"stream", A_STREAM}, {"Record function id", A_RF_ID}, {"Sequence number", A_SEQ},
    {"Fwd thread id", A_FWD_TID}, {"Python id", A_PYTHON_ID}, {"Python parent id", A_PYTHON_PARENT_ID},
    {"bytes", A_BYTES}, {"Bytes", A_MEM_BYTES}, {"Total Allocated", A_TOTAL_ALLOCATED},
    {"Total Reserved", A_TOTAL_RESERVED}, {"Device Id", A_DEVICE_ID}, {"Device Type", A_DEVICE_TYPE},
    {"Addr", A_ADDR}, {"flops", A_FLOPS}, {"Group size", A_GROUP_SIZE}, {"In msg nelems", A_IN_NELEMS},
    {"Out msg nelems", A_OUT_NELEMS}, {"external id", K_EXTERNAL_ID_OLD},
    {"Collective name", K_COLLECTIVE}, {"Process Group Name", K_PG_NAME}, {"dtype", K_DTYPE},
    {"Input Dims", K_INPUT_DIMS}, {"Input type", K_INPUT_TYPE}, {"Concrete Inputs", K_CONCRETE},
    {"grid", K_GRID}, {"block", K_BLOCK}, {"Process Group Ranks", K_PG_RANKS}, {"name", K_META_NAME},
    {"labels", K_LABELS}, {"Call stack", K_CALL_STACK}, {"kernel_file", K_KERNEL_FILE},
};
#define N_KEY_TABLE ((int)(sizeof(ARG_KEYS) / sizeof(ARG_KEYS[0])))

enum { E_PH, E_CAT, E_NAME, E_PID, E_TID, E_TS, E_DUR, E_ID, E_ARGS, N_EVENT_KEYS };
static const Key EVENT_KEYS[] = {
    {"ph", E_PH}, {"cat", E_CAT}, {"name", E_NAME}, {"pid", E_PID}, {"tid", E_TID},
    {"ts", E_TS}, {"dur", E_DUR}, {"id", E_ID}, {"args", E_ARGS},
};

/* Keys sorted by length: a key is compared only with the known keys of its length, by
 * its first and last eight bytes (all of it up to 16 bytes; the middle of longer ones is
 * compared once those match). */
#define MAX_KEY 32
typedef struct {
    uint64_t head, tail;
    const char *key;
    int slot;
} KeyWords;
static KeyWords arg_by_len[MAX_KEY + 1][8];
static KeyWords event_by_len[MAX_KEY + 1][8];

static inline uint64_t key_head(const char *s, size_t n) {
    uint64_t w = 0;
    if (n >= 8) {
        memcpy(&w, s, 8);
    } else {
        for (size_t i = 0; i < n; i++) w |= (uint64_t)(unsigned char)s[i] << (8 * i);
    }
    return w;
}

static inline uint64_t key_tail(const char *s, size_t n) {
    uint64_t w = 0;
    if (n >= 8) memcpy(&w, s + n - 8, 8);
    return w;
}

static void index_keys(const Key *keys, int n, KeyWords table[][8]) {
    for (int len = 0; len <= MAX_KEY; len++)
        for (int j = 0; j < 8; j++) table[len][j].slot = -1;
    for (int i = 0; i < n; i++) {
        size_t len = strlen(keys[i].key);
        for (int j = 0; j < 8; j++)
            if (table[len][j].slot < 0) {
                table[len][j] = (KeyWords){key_head(keys[i].key, len), key_tail(keys[i].key, len), keys[i].key, keys[i].slot};
                break;
            }
    }
}

static inline int lookup(yyjson_val *key, KeyWords table[][8]) {
    size_t len = yyjson_get_len(key);
    if (len > MAX_KEY) return -1;
    const char *s = yyjson_get_str(key);
    uint64_t head = key_head(s, len), tail = key_tail(s, len);
    for (int j = 0; j < 8 && table[len][j].slot >= 0; j++) {
        const KeyWords *k = &table[len][j];
        if (k->head == head && k->tail == tail && (len <= 16 || same_bytes(k->key + 8, s + 8, len - 16)))
            return k->slot;
    }
    return -1;
}

/* A missing cat or name reads as "" (the msgspec structs' default). */
static yyjson_val EMPTY_STR = {YYJSON_TYPE_STR | YYJSON_SUBTYPE_NONE, {.str = ""}};

typedef struct {
    Interner text[N_TEXT];
    Interner raw[N_RAW];
    Interner flow_text[4]; /* ph, cat, pid, tid */
    int32_t *text_codes[N_TEXT];
    int32_t *raw_codes[N_RAW];
    int32_t *flow_codes[4];
    double *ts, *dur, *flow_ts;
    int64_t *numbers[N_NUMBERS]; /* A_FLOPS holds doubles (same width) */
    uint8_t *missing[N_NUMBERS];
    Py_ssize_t filled[N_NUMBERS]; /* rows [0, filled) of numbers and missing written */
    int present[N_NUMBERS];
    int64_t *flow_id;
    uint8_t *flow_id_missing;
    int flow_id_present;
    Py_ssize_t n, n_flows;
    yyjson_val **names; /* per "M" event: name, pid, tid, args name, args labels */
    Py_ssize_t n_names, names_cap;
    yyjson_val *args[N_ARG_KEYS]; /* the current event's args by slot */
    int set[N_ARG_KEYS + 1];      /* the slots of args it set */
    int n_set;
} Columns;

#define BAIL (-2) /* not handled here: the caller takes the msgspec path */

static int code_of(Interner *t, yyjson_val *v, int32_t *out, int text) {
    if (v == NULL || yyjson_is_null(v)) {
        *out = -1;
        return 0;
    }
    if (text && !(yyjson_is_str(v) || yyjson_is_num(v) || yyjson_is_bool(v)))
        return BAIL; /* a list where a string belongs, or a number too big for 64 bits */
    int32_t code = intern(t, v);
    if (code < 0) return BAIL;
    *out = code;
    return 0;
}

/* text_int's first case: up to 16 hex digits after "0x"; -1 for any other text. */
static int hex_int(const char *s, size_t n, uint64_t *out) {
    if (n > 18) return -1; /* over 16 hex digits */
    uint64_t value = 0;
    for (size_t i = 2; i < n; i++) {
        char ch = s[i];
        int digit = ch >= '0' && ch <= '9' ? ch - '0'
                    : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                    : ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
        if (digit < 0) return -1;
        value = value * 16 + (uint64_t)digit;
    }
    *out = value;
    return 0;
}

/* text_int's second case: up to 18 decimal digits without a leading zero; -1 for any other text. */
static int decimal_int(const char *s, size_t n, uint64_t *out) {
    if (n == 0 || n > 18 || (s[0] == '0' && n > 1)) return -1; /* 18 digits fit */
    uint64_t value = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        value = value * 10 + (uint64_t)(s[i] - '0');
    }
    *out = value;
    return 0;
}

/* Integers written as text, as AMD traces do ("0x0", "2560"): hex digits after "0x", or
 * decimal digits without a leading zero, fitting int64 (what int(text, 0) reads alike);
 * -1 for any other text. */
static int text_int(const char *s, size_t n, int64_t *out) {
    uint64_t value = 0;
    int rc = n > 2 && s[0] == '0' && s[1] == 'x' ? hex_int(s, n, &value) : decimal_int(s, n, &value);
    if (rc < 0 || value > (uint64_t)INT64_MAX) return -1;
    *out = (int64_t)value;
    return 0;
}

/* An integer column value: JSON integers that fit int64, integers as text, or null. */
static int int_of(yyjson_val *v, int64_t *out, uint8_t *missing) {
    if (v == NULL || yyjson_is_null(v)) {
        *out = 0;
        *missing = 1;
        return 0;
    }
    if (yyjson_is_sint(v)) {
        *out = yyjson_get_sint(v);
    } else if (yyjson_is_uint(v) && yyjson_get_uint(v) <= (uint64_t)INT64_MAX) {
        *out = (int64_t)yyjson_get_uint(v);
    } else if (!yyjson_is_str(v) || text_int(yyjson_get_str(v), yyjson_get_len(v), out) < 0) {
        return BAIL; /* floats, bools, huge, other text: parse._numbers' slower rules */
    }
    *missing = 0;
    return 1;
}

static int float_of(yyjson_val *v, double *out, uint8_t *missing) {
    if (v == NULL || yyjson_is_null(v)) {
        *out = NAN;
        *missing = 1;
        return 0;
    }
    if (!yyjson_is_num(v)) return BAIL;
    *out = yyjson_get_num(v);
    *missing = 0;
    return 1;
}

static PyObject *scalar_object(yyjson_val *v) {
    if (v == NULL || yyjson_is_null(v)) Py_RETURN_NONE;
    switch (yyjson_get_tag(v) & 0xff) {
        case YYJSON_TYPE_STR | YYJSON_SUBTYPE_NONE:
        case YYJSON_TYPE_STR | YYJSON_SUBTYPE_NOESC:
            return PyUnicode_DecodeUTF8(yyjson_get_str(v), (Py_ssize_t)yyjson_get_len(v), NULL);
        case YYJSON_TYPE_NUM | YYJSON_SUBTYPE_UINT:
            return PyLong_FromUnsignedLongLong(yyjson_get_uint(v));
        case YYJSON_TYPE_NUM | YYJSON_SUBTYPE_SINT:
            return PyLong_FromLongLong(yyjson_get_sint(v));
        case YYJSON_TYPE_NUM | YYJSON_SUBTYPE_REAL:
            return PyFloat_FromDouble(yyjson_get_real(v));
        case YYJSON_TYPE_BOOL | YYJSON_SUBTYPE_TRUE:
            Py_RETURN_TRUE;
        case YYJSON_TYPE_BOOL | YYJSON_SUBTYPE_FALSE:
            Py_RETURN_FALSE;
        default:
            return NULL; /* arrays, objects: not a scalar (no exception set) */
    }
}

static int is_scalar(yyjson_val *v) {
    return v == NULL || yyjson_is_null(v) || yyjson_is_str(v) || yyjson_is_num(v) || yyjson_is_bool(v);
}

/* Keep an "M" event's naming fields (made Python objects once the GIL is held again). */
static int add_names(Columns *c, yyjson_val **ev, yyjson_val **args) {
    yyjson_val *parts[5] = {ev[E_NAME] ? ev[E_NAME] : &EMPTY_STR, ev[E_PID], ev[E_TID],
                            args[K_META_NAME], args[K_LABELS]};
    for (int i = 0; i < 5; i++)
        if (!is_scalar(parts[i])) return BAIL;
    if (c->n_names == c->names_cap) {
        Py_ssize_t cap = c->names_cap ? c->names_cap * 2 : 16;
        yyjson_val **grown = realloc(c->names, sizeof(yyjson_val *) * 5 * (size_t)cap);
        if (grown == NULL) return BAIL;
        c->names = grown;
        c->names_cap = cap;
    }
    memcpy(&c->names[5 * c->n_names++], parts, sizeof(parts));
    return 0;
}

/* Rows [filled, upto) of number column k: no value (0, missing). */
static inline void fill_numbers(Columns *c, int k, Py_ssize_t upto) {
    Py_ssize_t from = c->filled[k];
    if (from < upto) {
        memset(c->numbers[k] + from, 0, (size_t)(upto - from) * sizeof(int64_t));
        memset(c->missing[k] + from, 1, (size_t)(upto - from));
    }
    if (c->filled[k] < upto + 1) c->filled[k] = upto + 1;
}

static int add_timed(Columns *c, yyjson_val **ev, yyjson_val **args) {
    Py_ssize_t i = c->n;
    yyjson_val *text[N_TEXT] = {ev[E_PH], ev[E_CAT] ? ev[E_CAT] : &EMPTY_STR,
                                ev[E_NAME] ? ev[E_NAME] : &EMPTY_STR, ev[E_PID], ev[E_TID],
                                args[K_COLLECTIVE], args[K_PG_NAME], args[K_DTYPE], args[K_CALL_STACK],
                                args[K_KERNEL_FILE]};
    for (int k = 0; k < N_TEXT; k++)
        if (code_of(&c->text[k], text[k], &c->text_codes[k][i], 1)) return BAIL;
    yyjson_val *raw[N_RAW] = {args[K_INPUT_DIMS], args[K_INPUT_TYPE], args[K_CONCRETE],
                              args[K_GRID], args[K_BLOCK], args[K_PG_RANKS]};
    for (int k = 0; k < N_RAW; k++)
        if (code_of(&c->raw[k], raw[k], &c->raw_codes[k][i], 0)) return BAIL;
    uint8_t none;
    if (float_of(ev[E_TS], &c->ts[i], &none) == BAIL) return BAIL;
    if (float_of(ev[E_DUR], &c->dur[i], &none) == BAIL) return BAIL;
    if (none) c->dur[i] = 0.0;
    if (args[A_EXTERNAL_ID] == NULL || yyjson_is_null(args[A_EXTERNAL_ID])) {
        args[A_EXTERNAL_ID] = args[K_EXTERNAL_ID_OLD];
        if (args[A_EXTERNAL_ID] != NULL) c->set[c->n_set++] = A_EXTERNAL_ID;
    }
    /* a number column's rows are written as its keys are met: the rows before with no
     * value (0, missing) first (fill_numbers), the rest of the chunk once it ends */
    for (int j = 0; j < c->n_set; j++) {
        int k = c->set[j], rc;
        if (k >= N_NUMBERS || args[k] == NULL) continue;
        fill_numbers(c, k, i);
        if (k == A_FLOPS) {
            double value = 0.0; /* float_of leaves it unset where the value is missing */
            rc = float_of(args[k], &value, &c->missing[k][i]);
            memcpy(&c->numbers[k][i], &value, sizeof(value));
        } else {
            rc = int_of(args[k], &c->numbers[k][i], &c->missing[k][i]);
        }
        if (rc == BAIL) return BAIL;
        c->present[k] |= rc;
    }
    c->n++;
    return 0;
}

static int add_flow(Columns *c, yyjson_val **ev) {
    Py_ssize_t i = c->n_flows;
    yyjson_val *text[4] = {ev[E_PH], ev[E_CAT] ? ev[E_CAT] : &EMPTY_STR, ev[E_PID], ev[E_TID]};
    for (int k = 0; k < 4; k++)
        if (code_of(&c->flow_text[k], text[k], &c->flow_codes[k][i], 1)) return BAIL;
    uint8_t none;
    if (float_of(ev[E_TS], &c->flow_ts[i], &none) == BAIL) return BAIL;
    int rc = int_of(ev[E_ID], &c->flow_id[i], &c->flow_id_missing[i]);
    if (rc == BAIL) return BAIL;
    c->flow_id_present |= rc;
    c->n_flows++;
    return 0;
}

static yyjson_val NO_ARGS_OBJ = {YYJSON_TYPE_OBJ, {.u64 = 0}};

/* The event's known keys into ev by slot. */
static void event_keys(yyjson_val *event, yyjson_val **ev) {
    size_t i, max;
    yyjson_val *key, *val;
    yyjson_obj_foreach(event, i, max, key, val) {
        int slot = lookup(key, event_by_len);
        if (slot >= 0) ev[slot] = val; /* a repeated key: the last one wins, as in msgspec */
    }
}

/* The known args of an args object into c->args by slot; each slot set first noted in c->set. */
static void event_args(Columns *c, yyjson_val *a) {
    yyjson_val **args = c->args;
    size_t i, max;
    yyjson_val *key, *val;
    yyjson_obj_foreach(a, i, max, key, val) {
        int slot = lookup(key, arg_by_len);
        if (slot < 0) continue;
        if (args[slot] == NULL) c->set[c->n_set++] = slot;
        args[slot] = val;
    }
}

/* The event by its phase (a string): timed (X, i, I), flow (s, f, t) or names (M); any
 * other phase adds nothing. */
static int add_by_phase(Columns *c, yyjson_val **ev, yyjson_val *ph) {
    size_t len = yyjson_get_len(ph);
    const char *p = yyjson_get_str(ph);
    if (len == 1 && (p[0] == 'X' || p[0] == 'i' || p[0] == 'I')) return add_timed(c, ev, c->args);
    if (len == 1 && (p[0] == 's' || p[0] == 'f' || p[0] == 't')) return add_flow(c, ev);
    if (len == 1 && p[0] == 'M') return add_names(c, ev, c->args);
    return 0;
}

static int add_event_args(Columns *c, yyjson_val *event) {
    if (!yyjson_is_obj(event)) return BAIL;
    yyjson_val *ev[N_EVENT_KEYS] = {0};
    event_keys(event, ev);
    yyjson_val *ph = ev[E_PH];
    if (ph == NULL) return 0; /* ph "" (the default): neither timed, flow nor metadata */
    if (!yyjson_is_str(ph)) return BAIL;
    if (ev[E_TS] && !yyjson_is_num(ev[E_TS])) return BAIL;
    if (ev[E_DUR] && !yyjson_is_num(ev[E_DUR])) return BAIL;
    yyjson_val *a = ev[E_ARGS] ? ev[E_ARGS] : &NO_ARGS_OBJ;
    if (!yyjson_is_obj(a)) return BAIL;
    if (ev[E_ARGS]) event_args(c, a);
    return add_by_phase(c, ev, ph);
}

/* One event into the columns. c->args holds its args by slot, all NULL between events:
 * only the slots it set are cleared (cheaper than clearing them all for every event). */
static int add_event(Columns *c, yyjson_val *event) {
    int rc = add_event_args(c, event);
    for (int j = 0; j < c->n_set; j++) c->args[c->set[j]] = NULL;
    c->n_set = 0;
    return rc;
}

/* -- to Python ------------------------------------------------------------------------- */

static PyObject *array_bytes(const void *data, Py_ssize_t n, size_t width) {
    return PyBytes_FromStringAndSize((const char *)data, n * (Py_ssize_t)width);
}

/* (codes as int32 bytes, [distinct values]) of one interned column; (None, []) where the
 * chunk has no value in it (every code -1: most args columns of a trace, whose n codes
 * would be copied out for nothing). */
static PyObject *interned(Interner *t, int32_t *codes, Py_ssize_t n, int raw) {
    PyObject *values = PyList_New(t->count);
    if (values == NULL) return NULL;
    if (t->count == 0) return Py_BuildValue("(ON)", Py_None, values);
    for (Py_ssize_t i = 0; i < t->count; i++) {
        PyObject *item;
        if (raw) {
            size_t len = 0;
            char *text = yyjson_val_write(t->values[i], YYJSON_WRITE_NOFLAG, &len);
            if (text == NULL) {
                Py_DECREF(values);
                return PyErr_NoMemory();
            }
            item = PyBytes_FromStringAndSize(text, (Py_ssize_t)len);
            free(text);
        } else {
            item = scalar_object(t->values[i]);
            if (item == NULL && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "not a scalar");
        }
        if (item == NULL) {
            Py_DECREF(values);
            return NULL;
        }
        PyList_SET_ITEM(values, i, item);
    }
    return Py_BuildValue("(NN)", array_bytes(codes, n, sizeof(int32_t)), values);
}

static PyObject *numbers(int64_t *values, uint8_t *missing, int present, Py_ssize_t n) {
    if (!present) Py_RETURN_NONE;
    return Py_BuildValue("(NN)", array_bytes(values, n, sizeof(int64_t)), array_bytes(missing, n, 1));
}

static PyObject *names_list(Columns *c) {
    PyObject *names = PyList_New(c->n_names);
    if (names == NULL) return NULL;
    for (Py_ssize_t i = 0; i < c->n_names; i++) {
        PyObject *row = PyTuple_New(5);
        if (row == NULL) goto fail;
        PyList_SET_ITEM(names, i, row);
        for (int k = 0; k < 5; k++) {
            PyObject *item = scalar_object(c->names[5 * i + k]);
            if (item == NULL) goto fail;
            PyTuple_SET_ITEM(row, k, item);
        }
    }
    return names;
fail:
    Py_DECREF(names);
    return NULL;
}

static PyObject *to_python(Columns *c) {
    PyObject *text = PyTuple_New(N_TEXT), *raw = PyTuple_New(N_RAW), *nums = PyTuple_New(N_NUMBERS);
    PyObject *flow_text = PyTuple_New(4), *names = names_list(c);
    if (!text || !raw || !nums || !flow_text || !names) goto fail;
    for (int k = 0; k < N_TEXT; k++) {
        PyObject *col = interned(&c->text[k], c->text_codes[k], c->n, 0);
        if (col == NULL) goto fail;
        PyTuple_SET_ITEM(text, k, col);
    }
    for (int k = 0; k < N_RAW; k++) {
        PyObject *col = interned(&c->raw[k], c->raw_codes[k], c->n, 1);
        if (col == NULL) goto fail;
        PyTuple_SET_ITEM(raw, k, col);
    }
    for (int k = 0; k < N_NUMBERS; k++) {
        if (c->present[k] && c->filled[k] < c->n) { /* the rows after its last value */
            memset(c->numbers[k] + c->filled[k], 0, (size_t)(c->n - c->filled[k]) * sizeof(int64_t));
            memset(c->missing[k] + c->filled[k], 1, (size_t)(c->n - c->filled[k]));
        }
        PyObject *col = numbers(c->numbers[k], c->missing[k], c->present[k], c->n);
        if (col == NULL) goto fail;
        PyTuple_SET_ITEM(nums, k, col);
    }
    for (int k = 0; k < 4; k++) {
        PyObject *col = interned(&c->flow_text[k], c->flow_codes[k], c->n_flows, 0);
        if (col == NULL) goto fail;
        PyTuple_SET_ITEM(flow_text, k, col);
    }
    return Py_BuildValue("(nNNNNN(nNNN)N)", c->n, text, raw, array_bytes(c->ts, c->n, sizeof(double)),
                         array_bytes(c->dur, c->n, sizeof(double)), nums, c->n_flows, flow_text,
                         numbers(c->flow_id, c->flow_id_missing, c->flow_id_present, c->n_flows),
                         array_bytes(c->flow_ts, c->n_flows, sizeof(double)), names);
fail:
    Py_XDECREF(names);
    Py_XDECREF(text);
    Py_XDECREF(raw);
    Py_XDECREF(nums);
    Py_XDECREF(flow_text);
    return NULL;
}

/* -- allocation -------------------------------------------------------------------------- */

/* A bump allocator over a buffer the caller lends scan() (a memory map, reused chunk after
 * chunk by one thread): the chunk's document (yyjson's copy of the text and its values) and
 * its columns are made there, anything beyond it with malloc. Why: those are ~4.5x a
 * chunk's bytes, made and freed per chunk; from malloc they come out of the thread's glibc
 * arena (a second parsing thread keeps its own, whose unused top glibc never hands back)
 * and, freed, raise glibc's mmap and trim thresholds for the whole process. Everything in
 * the pool is given up at once when the next chunk starts (p->used = 0). */
typedef struct {
    char *base;
    size_t size, used;
} Pool;

#define POOL_ALIGN 16

/* Built with AddressSanitizer (tests/test_sanitizers.py), the pool is poisoned while a scan
 * uses it, each block made readable as it is taken and followed by a poisoned redzone: a
 * read or write past a block (yyjson's text, its values, a column) is reported as it would
 * be of malloc's memory. Elsewhere these are no-ops. */
#if defined(__SANITIZE_ADDRESS__)
#define SCAN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SCAN_ASAN 1
#endif
#endif
#ifdef SCAN_ASAN
#include <sanitizer/asan_interface.h>
#define POOL_REDZONE 32
#else
#define ASAN_POISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define ASAN_UNPOISON_MEMORY_REGION(addr, size) ((void)(addr), (void)(size))
#define POOL_REDZONE 0
#endif

/* Bytes a block of `size` takes in the pool (SIZE_MAX where that overflows: never room). */
static inline size_t pool_need(size_t size) {
    if (size > SIZE_MAX - POOL_REDZONE - POOL_ALIGN) return SIZE_MAX;
    return (size + POOL_REDZONE + (POOL_ALIGN - 1)) & ~(size_t)(POOL_ALIGN - 1);
}

static void *pool_take(Pool *p, size_t size) {
    if (p == NULL || p->base == NULL) return malloc(size);
    size_t need = pool_need(size);
    if (need > p->size - p->used) return malloc(size);
    void *out = p->base + p->used;
    p->used += need;
    ASAN_UNPOISON_MEMORY_REGION(out, size);
    return out;
}

/* The pool's memory, all of it, unusable until taken (a scan begins) or usable again (it ended). */
static void pool_begin(Pool *p) {
    if (p != NULL && p->base != NULL) ASAN_POISON_MEMORY_REGION(p->base, p->size);
}

static void pool_end(Pool *p) {
    if (p != NULL && p->base != NULL) ASAN_UNPOISON_MEMORY_REGION(p->base, p->size);
}

static inline int in_pool(Pool *p, const void *ptr) {
    return p != NULL && p->base != NULL && (const char *)ptr >= p->base && (const char *)ptr < p->base + p->size;
}

static void pool_give(Pool *p, void *ptr) {
    if (!in_pool(p, ptr)) free(ptr); /* pool memory is given up as a whole */
}

static void *alc_malloc(void *ctx, size_t size) { return pool_take((Pool *)ctx, size); }

static void *alc_realloc(void *ctx, void *ptr, size_t old_size, size_t size) {
    Pool *p = (Pool *)ctx;
    if (ptr == NULL) return pool_take(p, size);
    if (!in_pool(p, ptr)) return realloc(ptr, size);
    size_t offset = (size_t)((char *)ptr - p->base);
    size_t old_need = pool_need(old_size), need = pool_need(size);
    if (offset + old_need == p->used && need <= p->size - offset) { /* the last block: in place */
        p->used = offset + need;
        ASAN_POISON_MEMORY_REGION(ptr, need > old_need ? need : old_need);
        ASAN_UNPOISON_MEMORY_REGION(ptr, size);
        return ptr;
    }
    void *out = pool_take(p, size);
    if (out != NULL) memcpy(out, ptr, old_size < size ? old_size : size);
    return out;
}

static void alc_free(void *ctx, void *ptr) { pool_give((Pool *)ctx, ptr); }

static void columns_free(Columns *c, Pool *p) {
    for (int k = 0; k < N_TEXT; k++) {
        interner_free(&c->text[k]);
        pool_give(p, c->text_codes[k]);
    }
    for (int k = 0; k < N_RAW; k++) {
        interner_free(&c->raw[k]);
        pool_give(p, c->raw_codes[k]);
    }
    for (int k = 0; k < 4; k++) {
        interner_free(&c->flow_text[k]);
        pool_give(p, c->flow_codes[k]);
    }
    for (int k = 0; k < N_NUMBERS; k++) {
        pool_give(p, c->numbers[k]);
        pool_give(p, c->missing[k]);
    }
    pool_give(p, c->ts);
    pool_give(p, c->dur);
    pool_give(p, c->flow_ts);
    pool_give(p, c->flow_id);
    pool_give(p, c->flow_id_missing);
    free(c->names);
}

/* n events' columns (the pool's, where it has room; NULL: malloc). */
static int columns_init(Columns *c, size_t n, Pool *p) {
    memset(c, 0, sizeof(*c));
    size_t m = n ? n : 1;
    if (m > ((size_t)PY_SSIZE_T_MAX) / sizeof(int64_t)) return -1;
    int bad = 0;
    for (int k = 0; k < N_TEXT; k++) {
        bad |= interner_init(&c->text[k]);
        bad |= (c->text_codes[k] = pool_take(p, m * sizeof(int32_t))) == NULL;
    }
    for (int k = 0; k < N_RAW; k++) {
        bad |= interner_init(&c->raw[k]);
        bad |= (c->raw_codes[k] = pool_take(p, m * sizeof(int32_t))) == NULL;
    }
    for (int k = 0; k < 4; k++) {
        bad |= interner_init(&c->flow_text[k]);
        bad |= (c->flow_codes[k] = pool_take(p, m * sizeof(int32_t))) == NULL;
    }
    for (int k = 0; k < N_NUMBERS; k++) { /* written as values are read (fill_numbers) */
        bad |= (c->numbers[k] = pool_take(p, m * sizeof(int64_t))) == NULL;
        bad |= (c->missing[k] = pool_take(p, m)) == NULL;
    }
    bad |= (c->ts = pool_take(p, m * sizeof(double))) == NULL;
    bad |= (c->dur = pool_take(p, m * sizeof(double))) == NULL;
    bad |= (c->flow_ts = pool_take(p, m * sizeof(double))) == NULL;
    bad |= (c->flow_id = pool_take(p, m * sizeof(int64_t))) == NULL;
    bad |= (c->flow_id_missing = pool_take(p, m)) == NULL;
    return bad ? -1 : 0;
}

/* -- the module -------------------------------------------------------------------------- */

PyDoc_STRVAR(scan_doc,
             "scan(data, pool=None) -> columns | None\n\n"
             "The columns of a JSON array of Kineto events, or None where the msgspec path\n"
             "must decode it (malformed JSON or a value of an unexpected type).\n\n"
             "pool: a writable buffer (a memory map) the chunk's document and columns are\n"
             "made in where they fit (malloc beyond); its contents are overwritten, so one\n"
             "pool serves one thread at a time, chunk after chunk.");

/* Parse buf and fill c (runs without the GIL): 0 done, BAIL, or -1 out of memory. *doc is
 * the document to free (or NULL); c is always safe to free. */
static int read_events_opts(const char *buf, size_t len, Pool *p, yyjson_doc **doc, Columns *c,
                            yyjson_read_flag flags) {
    yyjson_alc alc = {alc_malloc, alc_realloc, alc_free, p};
    yyjson_read_err err;
    /* numbers beyond 64 bits stay text (as a RAW value): they take the msgspec path */
    *doc = yyjson_read_opts((char *)buf, len, YYJSON_READ_BIGNUM_AS_RAW | flags, p ? &alc : NULL, &err);
    yyjson_val *root = *doc ? yyjson_doc_get_root(*doc) : NULL;
    if (root == NULL || !yyjson_is_arr(root)) {
        memset(c, 0, sizeof(*c));
        return BAIL;
    }
    if (columns_init(c, yyjson_arr_size(root), p) < 0) return -1;
    size_t i, max;
    yyjson_val *event;
    yyjson_arr_foreach(root, i, max, event) {
        if (add_event(c, event) == BAIL) return BAIL;
    }
    return 0;
}

static int read_events(const char *buf, size_t len, Pool *p, yyjson_doc **doc, Columns *c) {
    return read_events_opts(buf, len, p, doc, c, 0);
}

/* scan()'s answer for read_events' status: the columns, None (BAIL), or NULL with an error. */
static PyObject *answer(int status, Columns *c) {
    if (status == -1) return PyErr_NoMemory();
    if (status == 0) {
        PyObject *result = to_python(c);
        if (result != NULL || PyErr_ExceptionMatches(PyExc_MemoryError)) return result;
        PyErr_Clear(); /* text that is not valid UTF-8 for Python: the msgspec path says */
    }
    return Py_NewRef(Py_None);
}

static PyObject *scan(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "scan(data, pool=None) takes 1 or 2 arguments");
        return NULL;
    }
    Py_buffer view, pool_view;
    int has_pool = nargs == 2 && args[1] != Py_None;
    if (has_pool && PyObject_GetBuffer(args[1], &pool_view, PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        if (has_pool) PyBuffer_Release(&pool_view);
        return NULL;
    }
    Pool pool = {has_pool ? (char *)pool_view.buf : NULL, has_pool ? (size_t)pool_view.len : 0, 0};
    Pool *p = has_pool ? &pool : NULL;
    yyjson_doc *doc;
    Columns c;
    int status;
    pool_begin(p);
    /* everything up to the Python objects runs without the GIL: chunks of one trace can
     * be scanned on several threads at once (trace.split) */
    Py_BEGIN_ALLOW_THREADS
    status = read_events((const char *)view.buf, (size_t)view.len, p, &doc, &c);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *result = answer(status, &c);
    columns_free(&c, p);
    if (doc) yyjson_doc_free(doc);
    pool_end(p);
    if (has_pool) PyBuffer_Release(&pool_view);
    return result;
}

/* -- a stretch of a file's events, cut into chunks here (POSIX pread) ---------------- */

#ifdef SCAN_HAS_PREAD
#include <errno.h>
#include <unistd.h>

static inline int json_space(char ch) { return ch == ' ' || ch == '\n' || ch == '\r' || ch == '\t'; }

/* Whether buf[at] is the '}' of an event followed by white space, ',', white space and the
 * '{' of the next one (parse._NEXT_EVENT, JSON's white space only); *next: that '{'. */
static int event_boundary(const char *buf, size_t len, size_t at, size_t *next) {
    if (buf[at] != '}') return 0;
    size_t i = at + 1;
    while (i < len && json_space(buf[i])) i++;
    if (i >= len || buf[i] != ',') return 0;
    i++;
    while (i < len && json_space(buf[i])) i++;
    if (i >= len || buf[i] != '{') return 0;
    *next = i;
    return 1;
}

/* Whether buf[:len] has an event boundary (event_boundary) whose '}' is before `limit`:
 * the last such '}' + 1, with *next, or 0 when there is none. */
static size_t last_cut(const char *buf, size_t len, size_t limit, size_t *next) {
    while (limit > 0) {
        const char *hit = NULL;
        for (const char *q = buf + limit; q > buf;) { /* memrchr is not C99 */
            q--;
            if (*q == '}') {
                hit = q;
                break;
            }
        }
        if (hit == NULL) return 0;
        size_t at = (size_t)(hit - buf);
        if (event_boundary(buf, len, at, next)) return at + 1;
        limit = at;
    }
    return 0;
}

/* A stretch of events to scan: bytes [base, base + len) of the file fd, read chunk by
 * chunk into the pool with pread (no copy of the whole stretch). */
typedef struct {
    int fd;
    long long base;
    size_t len;
} Stretch;

/* bytes read beyond a chunk's `chunk` bytes, for the end of its last event */
#define LOOKAHEAD (64 << 10)
#define LEAD 3 /* room for "[  " before a chunk */

/* len bytes of fd at offset into out; 0 when they were all read. */
static int read_fully(int fd, char *out, size_t len, long long offset) {
    while (len > 0) {
        ssize_t got = pread(fd, out, len, (off_t)offset);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        out += got;
        len -= (size_t)got;
        offset += got;
    }
    return 0;
}

/* The next chunk of the stretch from `start`, copied (read) into the pool between '[' and
 * ']' and decoded into c: 0, BAIL (also: a file that could not be read, or no end of an
 * event in reach: the caller reads from `start` on its own way) or -1 (no memory). *next:
 * where the chunk after it starts. Runs without the GIL. */
static int scan_chunk(const Stretch *st, size_t start, size_t chunk, Pool *p, char **text, yyjson_doc **doc,
                      Columns *c, size_t *next) {
    memset(c, 0, sizeof(*c));
    size_t rest = st->len - start, take = rest > chunk + LOOKAHEAD ? chunk + LOOKAHEAD : rest, end = take;
    size_t size = LEAD + take + 1 + YYJSON_PADDING_SIZE;
    if (size < take) return -1; /* overflow */
    *text = pool_take(p, size);
    if (*text == NULL) return -1;
    char *body = *text + LEAD;
    if (read_fully(st->fd, body, take, st->base + (long long)start) < 0) return BAIL;
    if (take < rest) { /* the chunk ends at the last event boundary before `chunk` bytes */
        size_t after;
        end = last_cut(body, take, chunk, &after);
        if (end == 0) return BAIL; /* one event of over `chunk` bytes: the caller's */
        *next = start + after;
    } else {
        *next = st->len;
    }
    /* yyjson reads indented JSON faster in its "pretty" mode, which it picks when the two
     * bytes after the '[' are white space: "[  " before events indented as Kineto's */
    size_t lead = end > 2 && json_space(body[1]) && json_space(body[2]) ? 3 : 1;
    char *json = body - lead;
    memcpy(json, "[  ", lead);
    body[end] = ']';
    memset(body + end + 1, 0, YYJSON_PADDING_SIZE);
    return read_events_opts(json, lead + end + 1, p, doc, c, YYJSON_READ_INSITU);
}

/* The chunk of the stretch from `start`, scanned without the GIL, as scan()'s columns (a new
 * reference in *result); *next: where the chunk after it starts. 0, BAIL (the rest from
 * `start` is the caller's: also text Python cannot decode) or -1 (an error is set). */
static int next_chunk(const Stretch *st, size_t start, size_t chunk, Pool *p, PyObject **result, size_t *next) {
    yyjson_doc *doc = NULL;
    Columns c;
    char *text = NULL;
    int status;
    *result = NULL;
    *next = st->len;
    Py_BEGIN_ALLOW_THREADS
    status = scan_chunk(st, start, chunk, p, &text, &doc, &c, next);
    Py_END_ALLOW_THREADS
    if (status == 0) {
        *result = to_python(&c);
        if (*result == NULL) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                status = -1;
            } else {
                PyErr_Clear(); /* text that is not valid UTF-8 for Python: the caller's route says */
                status = BAIL;
            }
        }
    }
    columns_free(&c, p);
    if (doc) yyjson_doc_free(doc);
    if (text) pool_give(p, text);
    if (status == -1 && !PyErr_Occurred()) PyErr_NoMemory();
    return status;
}

/* scan()'s columns of each chunk of the stretch, in a list, and where it stopped. */
static PyObject *scan_chunks(const Stretch *st, Py_ssize_t chunk, PyObject *pool_obj) {
    Py_buffer pool_view;
    int has_pool = pool_obj != Py_None;
    if (has_pool && PyObject_GetBuffer(pool_obj, &pool_view, PyBUF_WRITABLE) < 0) return NULL;
    PyObject *out = PyList_New(0);
    size_t start = 0;
    while (out != NULL && start < st->len) {
        Pool pool = {has_pool ? (char *)pool_view.buf : NULL, has_pool ? (size_t)pool_view.len : 0, 0};
        PyObject *result;
        size_t next;
        pool_begin(&pool);
        int status = next_chunk(st, start, (size_t)chunk, has_pool ? &pool : NULL, &result, &next);
        pool_end(&pool);
        if (status == BAIL) break; /* the rest from `start` on: the caller's */
        if (status != 0 || PyList_Append(out, result) < 0) {
            Py_XDECREF(result);
            Py_CLEAR(out);
            break;
        }
        Py_DECREF(result);
        start = next;
        if (PyErr_CheckSignals() < 0) { /* Ctrl-C between chunks, as between scan() calls */
            Py_CLEAR(out);
            break;
        }
    }
    if (has_pool) PyBuffer_Release(&pool_view);
    if (out == NULL) return NULL;
    return Py_BuildValue("(Nn)", out, (Py_ssize_t)(start < st->len ? start : st->len));
}

static Py_ssize_t chunk_arg(PyObject *arg) {
    Py_ssize_t chunk = PyLong_AsSsize_t(arg);
    if (chunk == -1 && PyErr_Occurred()) return -1;
    if (chunk < 1) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return -1;
    }
    return chunk;
}

PyDoc_STRVAR(scan_file_doc,
             "scan_file(fd, offset, length, pool, chunk) -> (list of columns, done)\n\n"
             "scan() of each chunk of about `chunk` bytes of [offset, offset + length) of\n"
             "the open file fd: events separated by commas, from the '{' of the first to\n"
             "the '}' of the last. Each chunk is read with pread straight into the pool\n"
             "(between '[' and ']') and decoded there: no copy of the stretch, no map of the\n"
             "file. Stops at the first chunk scan() would leave to msgspec, that cannot be\n"
             "read, or that is one event of over `chunk` bytes: `done` is the offset of its\n"
             "first '{' (length: all read); the caller reads the rest its own way.");

static PyObject *scan_file(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan_file(fd, offset, length, pool, chunk) takes 5 arguments");
        return NULL;
    }
    long fd_long = PyLong_AsLong(args[0]);
    int fd = fd_long > INT32_MAX ? -1 : (int)fd_long;
    long long offset = PyLong_AsLongLong(args[1]);
    Py_ssize_t length = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (fd < 0 || offset < 0 || length < 0) {
        PyErr_SetString(PyExc_ValueError, "fd, offset and length must not be negative");
        return NULL;
    }
    Py_ssize_t chunk = chunk_arg(args[4]);
    if (chunk < 0) return NULL;
    Stretch st = {fd, offset, (size_t)length};
    return scan_chunks(&st, chunk, args[3]);
}
#endif

/* -- the chunks' columns joined into a trace's columns (builder._Builder.finish) -------- */

/* Why: joining ~50 chunks a column in numpy is a call or two a chunk, ~40 columns (~6 ms of
 * a 100 MB trace's ~17 ms finish), and the fresh memory of the columns is made (zeroed)
 * while the GIL is held. Here a column is joined in one call that holds no GIL while it
 * makes its pages and copies, so the builder joins columns on two threads. */

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
/* The whole pages of [buf, buf + len) made at once (see columns.fresh); no-op on failure. */
static void populate(void *buf, size_t len) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = ((uintptr_t)buf + page - 1) & ~(page - 1), end = ((uintptr_t)buf + len) & ~(page - 1);
    if (end > start) (void)madvise((void *)start, end - start, MADV_POPULATE_WRITE);
}
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
/* The whole pages of [buf, buf + len) mapped for reading at once (see columns.lazy_zeros:
 * the zero page where they were never written); no-op on failure. */
static void populate_read(void *buf, size_t len) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t start = ((uintptr_t)buf + page - 1) & ~(page - 1), end = ((uintptr_t)buf + len) & ~(page - 1);
    if (end > start) (void)madvise((void *)start, end - start, MADV_POPULATE_READ);
}
#else
static void populate(void *buf, size_t len) {
    (void)buf;
    (void)len;
}
static void populate_read(void *buf, size_t len) {
    (void)buf;
    (void)len;
}
#endif

/* One chunk of a column: `rows` rows, from a (values or local codes) and b (mask or table);
 * a buffer whose .obj is NULL is not there. */
typedef struct {
    Py_buffer a, b;
    Py_ssize_t rows;
} Piece;

typedef struct {
    Piece *pieces;
    Py_ssize_t count;
} Pieces;

static void pieces_free(Pieces *ps) {
    for (Py_ssize_t i = 0; ps->pieces != NULL && i < ps->count; i++) {
        if (ps->pieces[i].a.obj != NULL) PyBuffer_Release(&ps->pieces[i].a);
        if (ps->pieces[i].b.obj != NULL) PyBuffer_Release(&ps->pieces[i].b);
    }
    PyMem_Free(ps->pieces);
}

typedef int (*PieceReader)(PyObject *item, Piece *piece);

/* Each item of the list `parts` read by `read` into ps (pieces_free it, whatever the answer). */
static int pieces_read(PyObject *parts, PieceReader read, Pieces *ps) {
    ps->pieces = NULL;
    ps->count = 0;
    if (!PyList_Check(parts)) {
        PyErr_SetString(PyExc_TypeError, "parts must be a list");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(parts);
    ps->pieces = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Piece));
    if (ps->pieces == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        ps->count = i + 1;
        if (read(PyList_GET_ITEM(parts, i), &ps->pieces[i]) < 0) return -1;
    }
    return 0;
}

static int bad_part(const char *what) {
    PyErr_SetString(PyExc_ValueError, what);
    return -1;
}

static int view_of(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) == 0) return 0;
    view->obj = NULL;
    return -1;
}

/* join_codes' part: rows with no value (an int), or (local int32 codes, int32 table). */
static int read_codes(PyObject *item, Piece *piece) {
    if (PyLong_Check(item)) {
        piece->rows = PyLong_AsSsize_t(item);
        return piece->rows < 0 ? bad_part("rows must not be negative") : 0;
    }
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) return bad_part("a part is an int or (codes, table)");
    if (view_of(PyTuple_GET_ITEM(item, 0), &piece->a) < 0 || view_of(PyTuple_GET_ITEM(item, 1), &piece->b) < 0)
        return -1;
    if (piece->a.len % 4 || piece->b.len % 4 || piece->b.len == 0) return bad_part("codes and table are int32");
    piece->rows = piece->a.len / 4;
    return 0;
}

/* join_numbers' part: (rows, None) (no value) or (rows, (int64 or float64 values, bool mask)). */
static int read_numbers(PyObject *item, Piece *piece) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) return bad_part("a part is (rows, values)");
    piece->rows = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 0));
    if (piece->rows < 0) return PyErr_Occurred() ? -1 : bad_part("rows must not be negative");
    PyObject *pair = PyTuple_GET_ITEM(item, 1);
    if (pair == Py_None) return 0;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) return bad_part("values are (values, mask)");
    if (view_of(PyTuple_GET_ITEM(pair, 0), &piece->a) < 0 || view_of(PyTuple_GET_ITEM(pair, 1), &piece->b) < 0)
        return -1;
    if (piece->b.len != piece->rows || piece->a.len != piece->rows * 8) return bad_part("values do not match rows");
    return 0;
}

/* join_bytes' part: a buffer. */
static int read_bytes(PyObject *item, Piece *piece) {
    if (view_of(item, &piece->a) < 0) return -1;
    piece->rows = piece->a.len;
    return 0;
}

static Py_ssize_t pieces_rows(const Pieces *ps) {
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < ps->count; i++) {
        if (ps->pieces[i].rows > PY_SSIZE_T_MAX - total) return -1;
        total += ps->pieces[i].rows;
    }
    return total;
}

/* The table entry of a local code (-1: the table's last, as numpy's take(mode="wrap")); 0
 * with *bad set for a code outside the table. */
static inline int32_t table_at(const int32_t *table, Py_ssize_t size, int32_t code, int *bad) {
    Py_ssize_t at = code < 0 ? (Py_ssize_t)code + size : (Py_ssize_t)code;
    if (at < 0 || at >= size) {
        *bad = 1;
        return -1;
    }
    return table[at];
}

#define GATHER(TYPE)                                                                      \
    for (Py_ssize_t i = 0; i < rows; i++) ((TYPE *)out)[i] = (TYPE)table_at(table, size, local[i], &bad)

/* out[i] = table[local[i]] for rows rows of `width` bytes each; -1 for a code outside the table. */
static int gather(char *out, int width, const int32_t *local, Py_ssize_t rows, const int32_t *table, Py_ssize_t size) {
    int bad = 0;
    switch (width) {
        case 1: GATHER(int8_t); break;
        case 2: GATHER(int16_t); break;
        case 4: GATHER(int32_t); break;
        default: GATHER(int64_t); break;
    }
    return bad ? -1 : 0;
}

#define FILL_MISSING(TYPE) \
    for (Py_ssize_t i = 0; i < rows; i++) ((TYPE *)out)[i] = (TYPE)-1

static void fill_missing(char *out, int width, Py_ssize_t rows) {
    switch (width) {
        case 1: memset(out, 0xff, (size_t)rows); break;
        case 2: FILL_MISSING(int16_t); break;
        case 4: FILL_MISSING(int32_t); break;
        default: FILL_MISSING(int64_t); break;
    }
}

/* join_codes' work, without the GIL: 0, or -1 for a code outside its table. */
static int codes_joined(char *out, size_t len, int width, const Pieces *ps) {
    populate(out, len);
    int bad = 0;
    for (Py_ssize_t i = 0; i < ps->count; i++) {
        const Piece *piece = &ps->pieces[i];
        if (piece->a.obj == NULL)
            fill_missing(out, width, piece->rows);
        else
            bad |= gather(out, width, piece->a.buf, piece->rows, piece->b.buf, piece->b.len / 4);
        out += piece->rows * width;
    }
    return bad ? -1 : 0;
}

/* The values' pages of each run of parts with values made at once (columns.partly_written's
 * advice: the parts with none are left as they are, lazily mapped zeros, never written). */
static void populate_runs(char *values, const Pieces *ps) {
    size_t at = 0, run = 0; /* the run of parts with values: [run, at) */
    for (Py_ssize_t i = 0; i < ps->count; i++) {
        size_t size = (size_t)ps->pieces[i].rows * 8;
        if (ps->pieces[i].a.obj == NULL) {
            if (at > run) populate(values + run, at - run);
            run = at + size;
        }
        at += size;
    }
    if (at > run) populate(values + run, at - run);
}

/* join_numbers' work, without the GIL: the values of parts with none are left as they are
 * (`some`: then the rest of the values' pages are mapped for reading at the end, see
 * columns.partly_written). */
static void numbers_joined(char *values, char *mask, Py_ssize_t rows, const Pieces *ps) {
    int some = 0;
    for (Py_ssize_t i = 0; i < ps->count; i++) some |= ps->pieces[i].a.obj == NULL;
    if (some)
        populate_runs(values, ps);
    else
        populate(values, (size_t)rows * 8);
    populate(mask, (size_t)rows);
    char *start = values;
    for (Py_ssize_t i = 0; i < ps->count; i++) {
        const Piece *piece = &ps->pieces[i];
        if (piece->a.obj == NULL) {
            memset(mask, 1, (size_t)piece->rows);
        } else {
            memcpy(values, piece->a.buf, (size_t)piece->a.len);
            memcpy(mask, piece->b.buf, (size_t)piece->rows);
        }
        values += piece->rows * 8;
        mask += piece->rows;
    }
    if (some) populate_read(start, (size_t)rows * 8);
}

static void bytes_joined(char *out, size_t len, const Pieces *ps) {
    populate(out, len);
    for (Py_ssize_t i = 0; i < ps->count; i++) {
        memcpy(out, ps->pieces[i].a.buf, (size_t)ps->pieces[i].a.len);
        out += ps->pieces[i].a.len;
    }
}

/* A writable buffer of `rows` rows of `width` bytes; -1 with an error set. */
static int out_view(PyObject *obj, Py_buffer *view, Py_ssize_t rows, Py_ssize_t width) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (rows < 0 || view->len / width != rows || view->len % width) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "the output does not hold the parts' rows");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(join_codes_doc,
             "join_codes(out, width, parts) -> None\n\n"
             "A text column's codes joined into `out` (writable, `width` bytes a code): each part\n"
             "an int (that many missing rows, -1) or (local codes, table), both int32: the rows'\n"
             "table[local] (-1: the table's last entry). ValueError for a code outside its table.");

static PyObject *join_codes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "join_codes(out, width, parts) takes 3 arguments");
        return NULL;
    }
    long width = PyLong_AsLong(args[1]);
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "width must be 1, 2, 4 or 8");
        return NULL;
    }
    Pieces ps;
    Py_buffer out;
    if (pieces_read(args[2], read_codes, &ps) < 0 || out_view(args[0], &out, pieces_rows(&ps), width) < 0) {
        pieces_free(&ps);
        return NULL;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = codes_joined(out.buf, (size_t)out.len, (int)width, &ps);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    pieces_free(&ps);
    if (status < 0) {
        bad_part("a code outside its table");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(join_numbers_doc,
             "join_numbers(values, mask, parts) -> None\n\n"
             "A number column joined into `values` (writable, 8 bytes a row) and `mask` (1 byte a\n"
             "row): each part (rows, None), missing (its values left as they are: zeros, in a\n"
             "lazily mapped `values`), or (rows, (values, mask)).");

static PyObject *join_numbers(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "join_numbers(values, mask, parts) takes 3 arguments");
        return NULL;
    }
    Pieces ps;
    Py_buffer values, mask;
    if (pieces_read(args[2], read_numbers, &ps) < 0) {
        pieces_free(&ps);
        return NULL;
    }
    Py_ssize_t rows = pieces_rows(&ps);
    if (out_view(args[0], &values, rows, 8) < 0) {
        pieces_free(&ps);
        return NULL;
    }
    if (out_view(args[1], &mask, rows, 1) < 0) {
        PyBuffer_Release(&values);
        pieces_free(&ps);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    numbers_joined(values.buf, mask.buf, rows, &ps);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&values);
    PyBuffer_Release(&mask);
    pieces_free(&ps);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(join_bytes_doc,
             "join_bytes(out, parts) -> None\n\n"
             "The buffers `parts` copied one after another into `out` (writable, of their size).");

static PyObject *join_bytes(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "join_bytes(out, parts) takes 2 arguments");
        return NULL;
    }
    Pieces ps;
    Py_buffer out;
    if (pieces_read(args[1], read_bytes, &ps) < 0 || out_view(args[0], &out, pieces_rows(&ps), 1) < 0) {
        pieces_free(&ps);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    bytes_joined(out.buf, (size_t)out.len, &ps);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    pieces_free(&ps);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL, scan_doc},
    {"join_codes", (PyCFunction)(void (*)(void))join_codes, METH_FASTCALL, join_codes_doc},
    {"join_numbers", (PyCFunction)(void (*)(void))join_numbers, METH_FASTCALL, join_numbers_doc},
    {"join_bytes", (PyCFunction)(void (*)(void))join_bytes, METH_FASTCALL, join_bytes_doc},
#ifdef SCAN_HAS_PREAD
    {"scan_file", (PyCFunction)(void (*)(void))scan_file, METH_FASTCALL, scan_file_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan",
    "Kineto events -> typed columns in C (yyjson); see tracemagic/trace/_scan.c.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    index_keys(ARG_KEYS, N_KEY_TABLE, arg_by_len);
    index_keys(EVENT_KEYS, N_EVENT_KEYS, event_by_len);
    return PyModule_Create(&module);
}
