/* The trace reader's native scanner: a run of Chrome-trace events (the bytes of `{...}, {...}, ...` as torch.profiler
 * writes them) straight into the reader's columns, with no Python object per event.
 *
 * It accepts a strict subset of what the msgspec path (producers/agent/trace_json.py: `_TypedEvent`, or `ChromeEvent`
 * where a pid or tid is a string) accepts, and gives the same columns for it.  Anything else -- a key or a category
 * spelt with escapes, a flow id that is a string, a number that is not plain (an integer beyond 18 digits, an integer
 * field written 1.0), invalid UTF-8, a duplicated field, nesting deeper than MAX_DEPTH, bytes that are not JSON --
 * makes it give up on the whole run (it returns None), and the reader decodes that run with msgspec as before, which
 * also says what is wrong with bytes that are not a trace.  Every byte read is checked against the run's end first:
 * nothing is read outside [lo, hi).
 *
 * scan(buffer, lo, hi) -> None | (strings, escaped, x, flows, order)
 *   strings  list[bytes]: the distinct string values of the kept fields (cat, name, the two process-group args, a pid
 *            or tid written as a string), raw (between the quotes, escapes not undone), numbered from 0 in the order
 *            they first occur; 0 is "".
 *   escaped  bytes: 1 where strings[i] holds a backslash (the reader decodes those as JSON).
 *   x        11 bytes objects, the complete ("ph": "X") events' columns: cat, name (int32 codes into strings), ts, dur
 *            (float64), pid, tid, correlation, device (int64), bytes (float64), pg (int32: the process group's
 *            description, else its name, else ""), Seq (int64); an absent integer is INT64_MIN and absent bytes are
 *            (double)INT64_MIN, as the msgspec path's defaults.
 *            A pid or tid written as a string is -(2**62) - 1 - its code into strings.
 *   flows    5 bytes objects, the flow events ("ph" "s" or "f", "cat" "ac2g" or "async", an integer "id"): is_end
 *            (uint8), id (int64), ts (float64), pid, tid (int64).
 *   order    3 bytes objects (int32): the codes of x's cat, name and pg, each in the order they first occur there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64
#define ABSENT INT64_MIN
#define BAIL (-1)
#define NOMEM (-2)

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static inline int buf_put(Buf *b, const void *x, size_t sz) {
    if (__builtin_expect(b->n + sz > b->cap, 0)) {
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->n + sz) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return NOMEM;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, x, sz);
    b->n += sz;
    return 0;
}

/* the distinct strings of a run: open addressing over (offset, length) slices of the run's bytes */
typedef struct {
    Py_ssize_t off, len;
    uint64_t hash;
    int32_t code; /* -1: empty slot */
} Slot;

typedef struct {
    Slot *slots;
    size_t cap;
    Buf list; /* Slot per code, in code order */
} Table;

typedef struct {
    const unsigned char *s;
    Py_ssize_t i, end;
    int depth;
    Table strings;
    Buf seen;     /* per code, a bit per string column of x (cat, name, pg) it was put in */
    Buf order[3]; /* per string column of x, its codes in the order they first occur in it (int32) */
    Buf x[11];
    Buf f[5];
} Scan;

static uint64_t hash_bytes(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = (uint64_t)n * 0x9E3779B97F4A7C15ULL;
    for (Py_ssize_t k = 0; k < n; k += 8) {
        uint64_t w = 0;
        memcpy(&w, p + k, (size_t)(n - k < 8 ? n - k : 8));
        h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
        h ^= h >> 29;
    }
    return h;
}

static int table_grow(Table *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    Slot *slots = malloc(cap * sizeof(Slot));
    if (!slots) return NOMEM;
    for (size_t k = 0; k < cap; k++) slots[k].code = -1;
    for (size_t k = 0; k < t->cap; k++) {
        if (t->slots[k].code < 0) continue;
        size_t j = t->slots[k].hash & (cap - 1);
        while (slots[j].code >= 0) j = (j + 1) & (cap - 1);
        slots[j] = t->slots[k];
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

/* the code of the slice [off, off+len) of the run's bytes, numbered when first seen */
static int32_t table_code(Scan *sc, Py_ssize_t off, Py_ssize_t len) {
    Table *t = &sc->strings;
    int32_t n = (int32_t)(t->list.n / sizeof(Slot));
    if ((size_t)(n + 1) * 2 > t->cap && table_grow(t) < 0) return NOMEM;
    uint64_t h = hash_bytes(sc->s + off, len);
    size_t j = h & (t->cap - 1);
    while (t->slots[j].code >= 0) {
        Slot *q = &t->slots[j];
        if (q->hash == h && q->len == len && memcmp(sc->s + q->off, sc->s + off, (size_t)len) == 0) return q->code;
        j = (j + 1) & (t->cap - 1);
    }
    Slot q = {off, len, h, n};
    static const uint8_t unseen = 0;
    if (buf_put(&t->list, &q, sizeof q) < 0 || buf_put(&sc->seen, &unseen, 1) < 0) return NOMEM;
    t->slots[j] = q;
    return n;
}

static inline void skip_ws(Scan *sc) {
    while (sc->i < sc->end) {
        unsigned char c = sc->s[sc->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
        sc->i++;
    }
}

static int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int read_hex4(Scan *sc, Py_ssize_t at) {
    if (at + 4 > sc->end) return -1;
    int v = 0;
    for (int k = 0; k < 4; k++) {
        int h = hexval(sc->s[at + k]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

/* A string at i (its opening quote): its content's slice, and whether it holds escapes.  Checks JSON's rules (no
 * control characters, valid escapes, surrogates in pairs) and UTF-8 (no overlong forms, no surrogates, <= U+10FFFF). */
static int read_string(Scan *sc, Py_ssize_t *off, Py_ssize_t *len, int *escaped) {
    const unsigned char *s = sc->s;
    Py_ssize_t i = sc->i + 1, end = sc->end;
    *escaped = 0;
    *off = i;
    while (i < end) {
        /* eight bytes at a time while none is a quote, a backslash, a control character or beyond ASCII */
        while (i + 8 <= end) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
            uint64_t q = w ^ (ones * '"'), b = w ^ (ones * '\\');
            uint64_t special = ((q - ones) & ~q) | ((b - ones) & ~b) | (w - ones * 0x20) | w;
            if (special & highs) break;
            i += 8;
        }
        if (i >= end) break;
        unsigned char c = s[i];
        if (c == '"') {
            *len = i - *off;
            sc->i = i + 1;
            return 0;
        }
        if (c < 0x20) return BAIL;
        if (c == '\\') {
            *escaped = 1;
            if (i + 1 >= end) return BAIL;
            unsigned char e = s[i + 1];
            if (e == 'u') {
                int u = read_hex4(sc, i + 2);
                if (u < 0) return BAIL;
                i += 6;
                if (u >= 0xDC00 && u <= 0xDFFF) return BAIL; /* a low surrogate alone */
                if (u >= 0xD800 && u <= 0xDBFF) {             /* a high surrogate: its low one must follow */
                    if (i + 1 >= end || s[i] != '\\' || s[i + 1] != 'u') return BAIL;
                    int lo = read_hex4(sc, i + 2);
                    if (lo < 0xDC00 || lo > 0xDFFF) return BAIL;
                    i += 6;
                }
                continue;
            }
            if (e != '"' && e != '\\' && e != '/' && e != 'b' && e != 'f' && e != 'n' && e != 'r' && e != 't')
                return BAIL;
            i += 2;
            continue;
        }
        if (c < 0x80) {
            i++;
            continue;
        }
        /* UTF-8 */
        int n;
        uint32_t cp;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            cp = c & 0x07;
        } else {
            return BAIL;
        }
        if (i + n >= end) return BAIL;
        for (int k = 1; k <= n; k++) {
            unsigned char d = s[i + k];
            if ((d & 0xC0) != 0x80) return BAIL;
            cp = (cp << 6) | (d & 0x3F);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
            return BAIL;
        i += n + 1;
    }
    return BAIL;
}

/* A JSON number at i: its extent, whether it is an integer literal (no fraction, no exponent) and how many digits
 * it has before any fraction. */
static int read_number(Scan *sc, Py_ssize_t *start, Py_ssize_t *stop, int *is_int, int *int_digits) {
    const unsigned char *s = sc->s;
    Py_ssize_t i = sc->i, end = sc->end;
    *start = i;
    *is_int = 1;
    if (i < end && s[i] == '-') i++;
    if (i >= end) return BAIL;
    Py_ssize_t d0 = i;
    if (s[i] == '0') {
        i++;
    } else if (s[i] >= '1' && s[i] <= '9') {
        while (i < end && s[i] >= '0' && s[i] <= '9') i++;
    } else {
        return BAIL;
    }
    *int_digits = (int)(i - d0 > 1000 ? 1000 : i - d0);
    if (i < end && s[i] == '.') {
        *is_int = 0;
        i++;
        Py_ssize_t f0 = i;
        while (i < end && s[i] >= '0' && s[i] <= '9') i++;
        if (i == f0) return BAIL;
    }
    if (i < end && (s[i] == 'e' || s[i] == 'E')) {
        *is_int = 0;
        i++;
        if (i < end && (s[i] == '+' || s[i] == '-')) i++;
        Py_ssize_t e0 = i;
        while (i < end && s[i] >= '0' && s[i] <= '9') i++;
        if (i == e0) return BAIL;
    }
    /* a number must be followed by a delimiter inside the run (it sits in an object that is not closed yet) */
    if (i >= end) return BAIL;
    *stop = i;
    sc->i = i;
    return 0;
}

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* An integer literal of at most 18 digits (so no overflow) as int64. */
static int number_int(Scan *sc, int64_t *out) {
    Py_ssize_t a, b;
    int is_int, digits;
    if (read_number(sc, &a, &b, &is_int, &digits) < 0 || !is_int || digits > 18) return BAIL;
    const unsigned char *s = sc->s;
    int neg = s[a] == '-';
    int64_t v = 0;
    for (Py_ssize_t k = a + neg; k < b; k++) v = v * 10 + (s[k] - '0');
    *out = neg ? -v : v;
    return 0;
}

/* Any JSON number as the nearest double: exactly (Clinger's fast path) where its digits make at most 2^53, at most 22
 * of them after the point, and it has no exponent (both the digits and the power of ten are exact doubles, and one division
 * rounds correctly), else strtod on a copy (glibc's is correctly rounded, as msgspec's parser is). */
static int number_double(Scan *sc, double *out) {
    Py_ssize_t a, b;
    int is_int, digits;
    if (read_number(sc, &a, &b, &is_int, &digits) < 0) return BAIL;
    if (is_int && digits > 18) return BAIL; /* beyond int64: left to msgspec */
    const unsigned char *s = sc->s;
    int neg = s[a] == '-';
    uint64_t m = 0;
    int nd = 0, frac = 0, in_frac = 0, simple = 1;
    for (Py_ssize_t k = a + neg; k < b && simple; k++) {
        unsigned char c = s[k];
        if (c == '.') {
            in_frac = 1;
        } else if (c >= '0' && c <= '9') {
            m = m * 10 + (uint64_t)(c - '0');
            if (m) nd++;
            frac += in_frac;
            simple = nd <= 19 && frac <= 22; /* 19 digits fit in 64 bits; the digits' value is checked below */
        } else {
            simple = 0; /* an exponent */
        }
    }
    if (simple && m <= (UINT64_C(1) << 53)) {
        double v = (double)m / POW10[frac];
        *out = neg ? -v : v;
        return 0;
    }
    char tmp[64];
    if (b - a >= (Py_ssize_t)sizeof tmp) return BAIL;
    memcpy(tmp, s + a, (size_t)(b - a));
    tmp[b - a] = 0;
    char *stop;
    double v = strtod(tmp, &stop);
    if (stop != tmp + (b - a) || !isfinite(v)) return BAIL;
    *out = v;
    return 0;
}

static int expect_lit(Scan *sc, const char *lit, size_t n) {
    if (sc->i + (Py_ssize_t)n > sc->end || memcmp(sc->s + sc->i, lit, n) != 0) return BAIL;
    sc->i += (Py_ssize_t)n;
    return 0;
}

static int skip_value(Scan *sc);

static int skip_container(Scan *sc, unsigned char close) {
    if (++sc->depth > MAX_DEPTH) return BAIL;
    sc->i++;
    skip_ws(sc);
    if (sc->i < sc->end && sc->s[sc->i] == close) {
        sc->i++;
        sc->depth--;
        return 0;
    }
    for (;;) {
        if (close == '}') {
            Py_ssize_t off, len;
            int esc;
            if (sc->i >= sc->end || sc->s[sc->i] != '"' || read_string(sc, &off, &len, &esc) < 0) return BAIL;
            skip_ws(sc);
            if (sc->i >= sc->end || sc->s[sc->i] != ':') return BAIL;
            sc->i++;
            skip_ws(sc);
        }
        int r = skip_value(sc);
        if (r < 0) return r;
        skip_ws(sc);
        if (sc->i >= sc->end) return BAIL;
        unsigned char c = sc->s[sc->i++];
        if (c == close) break;
        if (c != ',') return BAIL;
        skip_ws(sc);
    }
    sc->depth--;
    return 0;
}

static int skip_value(Scan *sc) {
    if (sc->i >= sc->end) return BAIL;
    unsigned char c = sc->s[sc->i];
    Py_ssize_t a, b;
    int x, y;
    switch (c) {
        case '"':
            return read_string(sc, &a, &b, &x);
        case '{':
            return skip_container(sc, '}');
        case '[':
            return skip_container(sc, ']');
        case 't':
            return expect_lit(sc, "true", 4);
        case 'f':
            return expect_lit(sc, "false", 5);
        case 'n':
            return expect_lit(sc, "null", 4);
        default:
            return read_number(sc, &a, &b, &x, &y);
    }
}

/* a kept string field: its code (escaped strings are coded by their raw bytes; the reader merges equal texts) */
static int string_code(Scan *sc, int32_t *code, Py_ssize_t *len, int *esc) {
    Py_ssize_t off;
    if (sc->i >= sc->end || sc->s[sc->i] != '"' || read_string(sc, &off, len, esc) < 0) return BAIL;
    int32_t c = table_code(sc, off, *len);
    if (c < 0) return c;
    *code = c;
    return 0;
}

/* the key at i, which must be a string without escapes: its slice */
static int read_key(Scan *sc, Py_ssize_t *off, Py_ssize_t *len) {
    int esc;
    if (sc->i >= sc->end || sc->s[sc->i] != '"' || read_string(sc, off, len, &esc) < 0 || esc) return BAIL;
    skip_ws(sc);
    if (sc->i >= sc->end || sc->s[sc->i] != ':') return BAIL;
    sc->i++;
    skip_ws(sc);
    return 0;
}

#define KEY_IS(lit) (len == (Py_ssize_t)(sizeof(lit) - 1) && memcmp(sc->s + off, lit, sizeof(lit) - 1) == 0)

/* a pid or tid: an integer, or a string (Kineto's "Spans", a tid written "25772") as STRING_ID - its code */
#define STRING_ID (-(INT64_C(1) << 62) - 1)
static int timeline_id(Scan *sc, int64_t *out) {
    if (sc->i < sc->end && sc->s[sc->i] == '"') {
        int32_t code;
        Py_ssize_t len;
        int esc;
        int r = string_code(sc, &code, &len, &esc);
        if (r < 0) return r;
        *out = STRING_ID - code;
        return 0;
    }
    return number_int(sc, out); /* at most 18 digits: never as low as STRING_ID */
}

typedef struct {
    int64_t corr, device, seq;
    double bytes;
    int32_t pg;
} Args;

static int read_args(Scan *sc, Args *a) {
    if (sc->i >= sc->end || sc->s[sc->i] != '{') return BAIL;
    if (++sc->depth > MAX_DEPTH) return BAIL;
    sc->i++;
    skip_ws(sc);
    int32_t desc = 0, gname = 0;
    Py_ssize_t desc_len = 0, gname_len = 0;
    unsigned seen = 0;
    int esc;
    if (sc->i < sc->end && sc->s[sc->i] == '}') {
        sc->i++;
    } else {
        for (;;) {
            Py_ssize_t off, len;
            if (read_key(sc, &off, &len) < 0) return BAIL;
            int r;
            unsigned bit = 0;
            if (KEY_IS("correlation")) {
                bit = 1;
                r = number_int(sc, &a->corr);
            } else if (KEY_IS("device")) {
                bit = 2;
                r = number_int(sc, &a->device);
            } else if (KEY_IS("bytes")) {
                bit = 4;
                r = number_double(sc, &a->bytes);
            } else if (KEY_IS("Process Group Description")) {
                bit = 8;
                r = string_code(sc, &desc, &desc_len, &esc);
            } else if (KEY_IS("Process Group Name")) {
                bit = 16;
                r = string_code(sc, &gname, &gname_len, &esc);
            } else if (KEY_IS("Seq")) {
                bit = 32;
                r = number_int(sc, &a->seq);
            } else {
                r = skip_value(sc);
            }
            if (r < 0) return r;
            if (bit) {
                if (seen & bit) return BAIL; /* a field twice */
                seen |= bit;
            }
            skip_ws(sc);
            if (sc->i >= sc->end) return BAIL;
            unsigned char c = sc->s[sc->i++];
            if (c == '}') break;
            if (c != ',') return BAIL;
            skip_ws(sc);
        }
    }
    sc->depth--;
    a->pg = desc_len ? desc : gname_len ? gname : 0;
    return 0;
}

/* a code put in string column `col` of x: noted in that column's order when it is its first there */
static inline int note(Scan *sc, int col, int32_t code) {
    uint8_t *seen = (uint8_t *)sc->seen.p + code;
    if (*seen & (1 << col)) return 0;
    *seen |= (uint8_t)(1 << col);
    return buf_put(&sc->order[col], &code, 4);
}

static int read_event(Scan *sc) {
    if (sc->i >= sc->end || sc->s[sc->i] != '{') return BAIL;
    sc->depth = 1;
    sc->i++;
    skip_ws(sc);
    Py_ssize_t ph_off = 0, ph_len = 0, cat_len = 0;
    int32_t cat = 0, name = 0;
    int64_t pid = 0, tid = 0, id = 0;
    int id_kind = 0; /* 0 none or null, 1 integer, 2 string */
    double ts = 0.0, dur = 0.0;
    Args a = {ABSENT, ABSENT, ABSENT, (double)ABSENT, 0};
    unsigned seen = 0;
    if (sc->i < sc->end && sc->s[sc->i] == '}') {
        sc->i++;
    } else {
        for (;;) {
            Py_ssize_t off, len;
            if (read_key(sc, &off, &len) < 0) return BAIL;
            int r = 0;
            unsigned bit = 0;
            if (KEY_IS("ph")) {
                int esc;
                bit = 1;
                if (sc->i >= sc->end || sc->s[sc->i] != '"' || read_string(sc, &ph_off, &ph_len, &esc) < 0 || esc)
                    return BAIL;
            } else if (KEY_IS("cat")) {
                bit = 2;
                int esc;
                r = string_code(sc, &cat, &cat_len, &esc);
                if (r == 0 && esc) return BAIL; /* a category spelt with escapes: left to msgspec */
            } else if (KEY_IS("name")) {
                bit = 4;
                int esc;
                Py_ssize_t name_len;
                r = string_code(sc, &name, &name_len, &esc);
            } else if (KEY_IS("pid")) {
                bit = 8;
                r = timeline_id(sc, &pid);
            } else if (KEY_IS("tid")) {
                bit = 16;
                r = timeline_id(sc, &tid);
            } else if (KEY_IS("ts")) {
                bit = 32;
                r = number_double(sc, &ts);
            } else if (KEY_IS("dur")) {
                bit = 64;
                r = number_double(sc, &dur);
            } else if (KEY_IS("id")) {
                bit = 128;
                unsigned char c = sc->i < sc->end ? sc->s[sc->i] : 0;
                if (c == '"') {
                    id_kind = 2;
                    r = skip_value(sc);
                } else if (c == 'n') {
                    id_kind = 0;
                    r = expect_lit(sc, "null", 4);
                } else {
                    id_kind = 1;
                    r = number_int(sc, &id);
                }
            } else if (KEY_IS("args")) {
                bit = 256;
                r = read_args(sc, &a);
            } else {
                r = skip_value(sc);
            }
            if (r < 0) return r;
            if (bit) {
                if (seen & bit) return BAIL;
                seen |= bit;
            }
            skip_ws(sc);
            if (sc->i >= sc->end) return BAIL;
            unsigned char c = sc->s[sc->i++];
            if (c == '}') break;
            if (c != ',') return BAIL;
            skip_ws(sc);
        }
    }
    if (ph_len != 1) return 0; /* not an event the reader keeps */
    unsigned char ph = sc->s[ph_off];
    if (ph == 'X') {
        if (buf_put(&sc->x[0], &cat, 4) < 0 || buf_put(&sc->x[1], &name, 4) < 0 || buf_put(&sc->x[2], &ts, 8) < 0 ||
            buf_put(&sc->x[3], &dur, 8) < 0 || buf_put(&sc->x[4], &pid, 8) < 0 || buf_put(&sc->x[5], &tid, 8) < 0 ||
            buf_put(&sc->x[6], &a.corr, 8) < 0 || buf_put(&sc->x[7], &a.device, 8) < 0 ||
            buf_put(&sc->x[8], &a.bytes, 8) < 0 || buf_put(&sc->x[9], &a.pg, 4) < 0 ||
            buf_put(&sc->x[10], &a.seq, 8) < 0 || note(sc, 0, cat) < 0 || note(sc, 1, name) < 0 || note(sc, 2, a.pg) < 0)
            return NOMEM;
        return 0;
    }
    if (ph != 's' && ph != 'f') return 0;
    const Slot *cs = &((const Slot *)sc->strings.list.p)[cat];
    int flow_cat = (cs->len == 4 && memcmp(sc->s + cs->off, "ac2g", 4) == 0) ||
                   (cs->len == 5 && memcmp(sc->s + cs->off, "async", 5) == 0);
    if (!flow_cat || id_kind == 0) return 0;
    if (id_kind == 2) return BAIL; /* a flow id that is a string: coded by its text, left to msgspec */
    uint8_t is_end = ph == 'f';
    if (buf_put(&sc->f[0], &is_end, 1) < 0 || buf_put(&sc->f[1], &id, 8) < 0 || buf_put(&sc->f[2], &ts, 8) < 0 ||
        buf_put(&sc->f[3], &pid, 8) < 0 || buf_put(&sc->f[4], &tid, 8) < 0)
        return NOMEM;
    return 0;
}

static int scan_run(Scan *sc) {
    if (table_grow(&sc->strings) < 0) return NOMEM;
    /* code 0 is "": every default string field */
    static const unsigned char empty = 0;
    const unsigned char *s = sc->s;
    sc->s = &empty;
    int32_t z = table_code(sc, 0, 0);
    sc->s = s;
    if (z != 0) return z < 0 ? z : BAIL;
    skip_ws(sc);
    for (;;) {
        int r = read_event(sc);
        if (r < 0) return r;
        skip_ws(sc);
        if (sc->i == sc->end) return 0;
        if (sc->s[sc->i] != ',') return BAIL;
        sc->i++;
        skip_ws(sc);
    }
}

static void scan_free(Scan *sc) {
    free(sc->strings.slots);
    free(sc->strings.list.p);
    free(sc->seen.p);
    for (int k = 0; k < 3; k++) free(sc->order[k].p);
    for (int k = 0; k < 11; k++) free(sc->x[k].p);
    for (int k = 0; k < 5; k++) free(sc->f[k].p);
}

static PyObject *columns_tuple(Buf *bufs, int n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *b = PyBytes_FromStringAndSize(bufs[k].p ? bufs[k].p : "", (Py_ssize_t)bufs[k].n);
        if (!b) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, b);
    }
    return t;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "Onn", &obj, &lo, &hi)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (lo < 0 || hi > view.len || lo > hi) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan: lo and hi must satisfy 0 <= lo <= hi <= len(buffer)");
        return NULL;
    }
    Scan sc;
    memset(&sc, 0, sizeof sc);
    sc.s = (const unsigned char *)view.buf;
    sc.i = lo;
    sc.end = hi;
    PyObject *out = NULL;
    PyThreadState *save = PyEval_SaveThread(); /* the buffer is exported: a bytearray cannot be resized meanwhile */
    int r = scan_run(&sc);
    PyEval_RestoreThread(save);
    if (r == NOMEM) {
        PyErr_NoMemory();
        goto done;
    }
    if (r < 0) {
        out = Py_None;
        Py_INCREF(out);
        goto done;
    }
    {
        const Slot *slots = (const Slot *)sc.strings.list.p;
        Py_ssize_t n = (Py_ssize_t)(sc.strings.list.n / sizeof(Slot));
        PyObject *strings = PyList_New(n);
        PyObject *escaped = PyBytes_FromStringAndSize(NULL, n);
        if (!strings || !escaped) {
            Py_XDECREF(strings);
            Py_XDECREF(escaped);
            goto done;
        }
        char *esc = PyBytes_AS_STRING(escaped);
        for (Py_ssize_t k = 0; k < n; k++) {
            const char *p = (const char *)sc.s + slots[k].off;
            if (k == 0) p = "";
            PyObject *b = PyBytes_FromStringAndSize(p, slots[k].len);
            if (!b) {
                Py_DECREF(strings);
                Py_DECREF(escaped);
                goto done;
            }
            PyList_SET_ITEM(strings, k, b);
            esc[k] = memchr(p, '\\', (size_t)slots[k].len) != NULL;
        }
        PyObject *x = columns_tuple(sc.x, 11);
        PyObject *f = x ? columns_tuple(sc.f, 5) : NULL;
        PyObject *order = f ? columns_tuple(sc.order, 3) : NULL;
        if (!x || !f || !order) {
            Py_DECREF(strings);
            Py_DECREF(escaped);
            Py_XDECREF(x);
            Py_XDECREF(f);
            goto done;
        }
        out = Py_BuildValue("(NNNNN)", strings, escaped, x, f, order);
    }
done:
    scan_free(&sc);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, "scan(buffer, lo, hi): a run of trace events as columns, or None (see the source)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tracescan", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tracescan(void) { return PyModule_Create(&module); }
