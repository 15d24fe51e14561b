/* The compiled reader of plain OpenAI chat and completions response bodies (clawpipe.lake.openai_fast).

   scan(body) walks the whole body once, checking it is JSON (strings' escapes and UTF-8, numbers' grammar,
   nesting), and keeps only what landing stores as columns: the prompt ids, policy version, spliced tokens,
   model, usage counts, and per choice its index, finish reason, tool calls (their JSON text), token ids,
   own prompt ids and sampled logprobs. Ids and logprobs go straight into array.array buffers ('i', 'd'):
   no Python number is made per token, and the rest of the body (message text, logprob entries' text,
   bytes and top_logprobs) is stepped over without building anything.

   It answers None for anything outside the plain shape (an error body, a value of another type, a key
   spelled with escapes, a key twice, an id outside [0, 2^31-1], a number a double cannot hold, a \u escape
   of a lone surrogate, a kept string with escapes, deep nesting, invalid JSON): the Python decoders then
   decide, so this reader only ever agrees with them or steps aside (tests/lake/test_openai_scan.py holds
   it to that). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 128
#define INT32_TOP 2147483647LL
#define ONES 0x0101010101010101ULL
#define ALWAYS_INLINE inline __attribute__((always_inline))

_Static_assert(sizeof(int) == 4, "array.array('i') must hold 4-byte ids");

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
    int depth;
} Scan;

static PyObject *ArrayType;  /* array.array */

/* -- growable buffers ------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    Py_ssize_t len, cap;  /* bytes */
} Buf;

static int buf_push(Buf *b, const void *v, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->len + n) cap *= 2;
        char *d = PyMem_Realloc(b->data, cap);
        if (!d) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, v, n);
    b->len += n;
    return 0;
}

static PyObject *buf_array(Buf *b, const char *typecode) {
    return PyObject_CallFunction(ArrayType, "sy#", typecode, b->data ? b->data : "", b->len);
}

/* -- the JSON grammar ------------------------------------------------------------------------------- */

static inline void ws(Scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t')) s->p++;
}

static inline int eat(Scan *s, unsigned char c) {
    ws(s);
    if (s->p < s->end && *s->p == c) {
        s->p++;
        return 1;
    }
    return 0;
}

static inline int hexval(unsigned char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A string from its opening quote: *start and *stop span its raw content, *escaped tells whether it holds a
   backslash. 0 on success, -1 where it is not a well-formed JSON string of valid UTF-8 (or escapes a lone
   surrogate: left to the Python decoders). */
static ALWAYS_INLINE int string(Scan *s, const unsigned char **start, const unsigned char **stop, int *escaped) {
    const unsigned char *p = s->p, *end = s->end;
    if (p >= end || *p != '"') return -1;
    p++;
    *start = p;
    *escaped = 0;
    for (;;) {
        /* eight plain bytes at a time (none a quote, backslash, control or non-ASCII byte) */
        while (end - p >= 8) {
            uint64_t w;
            memcpy(&w, p, 8);
            uint64_t q = w ^ (ONES * '"'), b = w ^ (ONES * '\\');
            uint64_t hit = ((q - ONES) & ~q) | ((b - ONES) & ~b) | (w - ONES * 0x20) | w;
            if (hit & (ONES * 0x80)) break;
            p += 8;
        }
        while (p < end && *p >= 0x20 && *p < 0x80 && *p != '"' && *p != '\\') p++;
        if (p >= end) return -1;
        unsigned char c = *p;
        if (c == '"') break;
        if (c < 0x20) return -1;
        if (c == '\\') {
            *escaped = 1;
            if (p + 1 >= end) return -1;
            unsigned char e = p[1];
            if (e == 'u') {
                if (p + 6 > end) return -1;
                int cp = 0;
                for (int k = 2; k < 6; k++) {
                    int h = hexval(p[k]);
                    if (h < 0) return -1;
                    cp = cp * 16 + h;
                }
                p += 6;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return -1; /* a low surrogate alone */
                if (cp >= 0xD800 && cp <= 0xDBFF) {           /* a high one: a low one must follow */
                    if (p + 6 > end || p[0] != '\\' || p[1] != 'u') return -1;
                    int lo = 0;
                    for (int k = 2; k < 6; k++) {
                        int h = hexval(p[k]);
                        if (h < 0) return -1;
                        lo = lo * 16 + h;
                    }
                    if (lo < 0xDC00 || lo > 0xDFFF) return -1;
                    p += 6;
                }
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                p += 2;
            } else {
                return -1;
            }
            continue;
        }
        /* UTF-8, strictly: no overlong forms, no surrogates, nothing past U+10FFFF */
        if (c >= 0xC2 && c <= 0xDF) {
            if (p + 1 >= end || (p[1] & 0xC0) != 0x80) return -1;
            p += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (p + 2 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return -1;
            if (c == 0xE0 && p[1] < 0xA0) return -1;
            if (c == 0xED && p[1] > 0x9F) return -1;
            p += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (p + 3 >= end || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return -1;
            if (c == 0xF0 && p[1] < 0x90) return -1;
            if (c == 0xF4 && p[1] > 0x8F) return -1;
            p += 4;
        } else {
            return -1;
        }
    }
    *stop = p;
    s->p = p + 1;
    return 0;
}

/* A number: its span, and whether it is an integer (no fraction, no exponent). -1 if not JSON's grammar. */
static ALWAYS_INLINE int number(Scan *s, const unsigned char **start, int *integral) {
    const unsigned char *p = s->p, *end = s->end;
    *start = p;
    *integral = 1;
    if (p < end && *p == '-') p++;
    if (p >= end) return -1;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') p++;
    } else {
        return -1;
    }
    if (p < end && *p == '.') {
        *integral = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        *integral = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    s->p = p;
    return 0;
}

static int literal(Scan *s, const char *word, Py_ssize_t n) {
    if (s->end - s->p < n || memcmp(s->p, word, n) != 0) return -1;
    s->p += n;
    return 0;
}

static int skip_value(Scan *s);

static int skip_container(Scan *s, unsigned char close, int keyed) {
    if (++s->depth > MAX_DEPTH) return -1;
    s->p++;
    if (eat(s, close)) {
        s->depth--;
        return 0;
    }
    for (;;) {
        ws(s);
        if (keyed) {
            const unsigned char *a, *b;
            int esc;
            if (string(s, &a, &b, &esc) < 0 || !eat(s, ':')) return -1;
            ws(s);
        }
        if (skip_value(s) < 0) return -1;
        if (eat(s, ',')) continue;
        if (eat(s, close)) break;
        return -1;
    }
    s->depth--;
    return 0;
}

/* Step over one value, checking it is well formed. */
static int skip_value(Scan *s) {
    ws(s);
    if (s->p >= s->end) return -1;
    const unsigned char *a, *b;
    int flag;
    switch (*s->p) {
    case '"': return string(s, &a, &b, &flag);
    case '{': return skip_container(s, '}', 1);
    case '[': return skip_container(s, ']', 0);
    case 't': return literal(s, "true", 4);
    case 'f': return literal(s, "false", 5);
    case 'n': return literal(s, "null", 4);
    default: return number(s, &a, &flag);
    }
}

static inline int is_null(Scan *s) {
    ws(s);
    return s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0 && (s->p += 4, 1);
}

/* -- typed values ------------------------------------------------------------------------------------- */

/* An integer in [lo, hi] into *out. -1 for anything else (a fraction, an exponent, out of range). */
static int int_in(Scan *s, long long lo, long long hi, long long *out) {
    ws(s);
    const unsigned char *a;
    int integral;
    if (number(s, &a, &integral) < 0 || !integral) return -1;
    const unsigned char *p = a;
    int neg = *p == '-';
    if (neg) p++;
    if (s->p - p > 18) return -1;  /* past what int64 surely holds: the Python decoders decide */
    long long v = 0;
    for (; p < s->p; p++) v = v * 10 + (*p - '0');
    if (neg) v = -v;
    if (v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

/* An int or null as a Python object (None for null); NULL with no exception set = not the plain shape. */
static PyObject *int_or_null(Scan *s) {
    if (is_null(s)) Py_RETURN_NONE;
    long long v;
    if (int_in(s, -INT64_MAX, INT64_MAX, &v) < 0) return NULL;
    return PyLong_FromLongLong(v);
}

/* A string without escapes, or null, as a Python object. */
static PyObject *str_or_null(Scan *s) {
    if (is_null(s)) Py_RETURN_NONE;
    const unsigned char *a, *b;
    int esc;
    if (string(s, &a, &b, &esc) < 0 || esc) return NULL;
    PyObject *out = PyUnicode_DecodeUTF8((const char *)a, b - a, "strict");
    if (!out) PyErr_Clear();
    return out;
}

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
/* The run of digits (1 to 8) at p, which starts with one and has 8 readable bytes: its length, and its value
   in *v, eight bytes at a time (the digits moved to the top of the word, zeros below them, then paired
   up: 1-digit to 2-digit to 4-digit to 8-digit numbers by three multiplications). */
static inline int leading_digits(const unsigned char *p, long long *v) {
    uint64_t w;
    memcpy(&w, p, 8);
    /* a byte below '0' borrows (high bit set), one above '9' carries into it: the lowest such is exact */
    uint64_t nondigit = ((w - ONES * '0') | (w + ONES * 0x46)) & (ONES * 0x80);
    int n = nondigit ? __builtin_ctzll(nondigit) >> 3 : 8;
    uint64_t d = w << (8 * (8 - n)); /* n >= 1: a shift below 64 */
    d = ((d & (ONES * 0x0F)) * 2561) >> 8;
    d = ((d & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
    *v = (long long)(uint32_t)(((d & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32);
    return n;
}
#endif

/* A list of ids in [0, 2^31-1] into an array('i'), or null (None). */
static PyObject *ids_or_null(Scan *s) {
    if (is_null(s)) Py_RETURN_NONE;
    if (!eat(s, '[')) return NULL;
    Buf b = {0};
    PyObject *out = NULL;
    if (!eat(s, ']')) {
        for (;;) {
            /* the common form first, in one tight loop: 1-10 digits, no sign, no leading zero */
            const unsigned char *p = s->p, *end = s->end;
            if (p < end && *p >= '1' && *p <= '9') {
                long long v;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                if (end - p >= 8) {
                    int n = leading_digits(p, &v);
                    p += n;
                    if (n == 8 && p < end && (unsigned)(*p - '0') < 10) v = v * 10 + (*p++ - '0');
                    if (n == 8 && p < end && (unsigned)(*p - '0') < 10) v = v * 10 + (*p++ - '0');
                } else
#endif
                {
                    v = *p++ - '0';
                    const unsigned char *stop = p + 9 < end ? p + 9 : end;
                    while (p < stop && (unsigned)(*p - '0') < 10) v = v * 10 + (*p++ - '0');
                }
                if (p < end && ((unsigned)(*p - '0') < 10 || *p == '.' || *p == 'e' || *p == 'E')) goto done;
                if (v > INT32_TOP) goto done;
                s->p = p;
                int x = (int)v;
                if (b.len + (Py_ssize_t)sizeof x <= b.cap) {
                    memcpy(b.data + b.len, &x, sizeof x);
                    b.len += sizeof x;
                } else if (buf_push(&b, &x, sizeof x) < 0) {
                    goto done;
                }
            } else {
                long long v;
                if (int_in(s, 0, INT32_TOP, &v) < 0) goto done;
                int x = (int)v;
                if (buf_push(&b, &x, sizeof x) < 0) goto done;
            }
            if (s->p < end && *s->p == ',') {
                s->p++;
                continue;
            }
            if (eat(s, ',')) continue;
            if (eat(s, ']')) break;
            goto done;
        }
    }
    out = buf_array(&b, "i");
done:
    PyMem_Free(b.data);
    return out;
}

#if LDBL_MANT_DIG >= 64
/* Most logprobs have at most 19 significant digits and a small decimal exponent: their digits m and 10^k
   are exact in a long double (64+ bit mantissa), so m / 10^k (or m * 10^k) is one correctly rounded long
   double operation. Rounding that to a double is the correctly rounded double unless the long double lies
   exactly half-way between two doubles (it may have been rounded onto the midpoint): then -1, and the
   caller takes the exact reader. tests/lake/test_openai_scan.py checks it against float() on millions. */
static const long double POW10[] = {1e0L,  1e1L,  1e2L,  1e3L,  1e4L,  1e5L,  1e6L,  1e7L,  1e8L,  1e9L,
                                     1e10L, 1e11L, 1e12L, 1e13L, 1e14L, 1e15L, 1e16L, 1e17L, 1e18L, 1e19L,
                                     1e20L, 1e21L, 1e22L, 1e23L, 1e24L, 1e25L, 1e26L, 1e27L};
#define POW10_TOP 27 /* 5^27 < 2^64: exact */

static const uint64_t P10U[] = {1ULL, 10ULL, 100ULL, 1000ULL, 10000ULL, 100000ULL, 1000000ULL, 10000000ULL,
                                 100000000ULL, 1000000000ULL, 10000000000ULL, 100000000000ULL, 1000000000000ULL,
                                 10000000000000ULL, 100000000000000ULL, 1000000000000000ULL, 10000000000000000ULL,
                                 100000000000000000ULL, 1000000000000000000ULL, 10000000000000000000ULL};

/* The digits at *pp onto *m (as more digits of one decimal), *n of them; -1 past 19 significant digits. */
static inline int digit_run(const unsigned char **pp, const unsigned char *end, uint64_t *m, int *n) {
    const unsigned char *p = *pp;
    int total = 0;
    while (p < end && (unsigned)(*p - '0') < 10) {
        long long v = 0;
        int k = 0;
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        if (end - p >= 8) {
            k = leading_digits(p, &v);
        } else
#endif
        {
            while (k < 8 && p + k < end && (unsigned)(p[k] - '0') < 10) v = v * 10 + (p[k++] - '0');
        }
        if (*m >= P10U[19 - k]) return -1;
        *m = *m * P10U[k] + (uint64_t)v;
        p += k;
        total += k;
        if (k < 8) break;
    }
    *pp = p;
    *n = total;
    return 0;
}

/* A number in JSON's grammar at s->p read by the quick path: 0 with *out set and the scanner past it, -1
   (the scanner where it was) for the exact reader to decide. */
static int quick_double(Scan *s, double *out) {
    const unsigned char *p = s->p, *end = s->end;
    int neg = 0, n;
    if (p < end && *p == '-') {
        neg = 1;
        p++;
    }
    uint64_t m = 0;
    long e = 0;
    if (p < end && *p == '0') {
        p++;
    } else if (p < end && *p >= '1' && *p <= '9') {
        if (digit_run(&p, end, &m, &n) < 0) return -1;
    } else {
        return -1;
    }
    if (p < end && *p == '.') {
        p++;
        if (digit_run(&p, end, &m, &n) < 0 || n == 0) return -1;
        e -= n;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        int eneg = 0;
        if (p < end && (*p == '+' || *p == '-')) eneg = *p++ == '-';
        if (p >= end || (unsigned)(*p - '0') >= 10) return -1;
        long x = 0;
        for (; p < end && (unsigned)(*p - '0') < 10; p++) {
            if (x > 100000) return -1;
            x = x * 10 + (*p - '0');
        }
        e += eneg ? -x : x;
    }
    long double r = (long double)m;
    if (m != 0) {
        if (e < -POW10_TOP || e > POW10_TOP) return -1;
        r = e < 0 ? r / POW10[-e] : r * POW10[e];
    }
    double d = (double)r;
#if LDBL_MANT_DIG == 64 && defined(__x86_64__)
    /* x87: the 64-bit mantissa holds the double's 53 bits and 11 more; 10000000000 there is a midpoint
       (for a normal double, which is all a number of this size can be) */
    uint64_t mant;
    memcpy(&mant, &r, 8);
    if ((mant & 0x7FF) == 0x400) return -1;
#else
    if ((long double)d != r) {
        double other = nextafter(d, r > (long double)d ? INFINITY : -INFINITY);
        if (((long double)d + (long double)other) / 2 == r) return -1; /* on a midpoint: maybe rounded there */
    }
#endif
    *out = neg ? -d : d;
    s->p = p;
    return 0;
}
#else
static int quick_double(Scan *s, double *out) { return -1; }
#endif

/* A JSON number as a finite double, correctly rounded, whatever the locale. */
static int finite_double(Scan *s, double *out) {
    ws(s);
    if (quick_double(s, out) == 0) return 0;
    const unsigned char *a;
    int integral;
    if (number(s, &a, &integral) < 0) return -1;
    if (s->p >= s->end) return -1; /* a number that ends the body (cut short): and the exact reader reads on to a
                                      non-digit, which a view of a larger buffer may not end with */
    char *stop;
    double v = PyOS_string_to_double((const char *)a, &stop, NULL);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if ((const unsigned char *)stop != s->p || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

/* Every key of an object in turn: 1 with *key and *n set and the scanner at its value, 0 at the end, -1 on
   bad input (a key with escapes among it). Call with first=1 at the opening brace. */
static ALWAYS_INLINE int next_key(Scan *s, int *first, const unsigned char **key, Py_ssize_t *n) {
    if (*first) {
        *first = 0;
        if (!eat(s, '{')) return -1;
        if (++s->depth > MAX_DEPTH) return -1;
        if (eat(s, '}')) {
            s->depth--;
            return 0;
        }
    } else {
        if (eat(s, '}')) {
            s->depth--;
            return 0;
        }
        if (!eat(s, ',')) return -1;
    }
    ws(s);
    const unsigned char *a, *b;
    int esc;
    if (string(s, &a, &b, &esc) < 0 || esc || !eat(s, ':')) return -1;
    *key = a;
    *n = b - a;
    return 1;
}

#define KEY(lit) (n == (Py_ssize_t)(sizeof(lit) - 1) && memcmp(key, lit, sizeof(lit) - 1) == 0)
/* a key met twice: the Python decoders decide which counts */
#define ONCE(bit) do { if (seen & (bit)) goto fail; seen |= (bit); } while (0)

/* logprobs.content: [{"logprob": x, ...}, ...] -> doubles */
static int logprob_entries(Scan *s, Buf *out) {
    if (!eat(s, '[')) return -1;
    if (eat(s, ']')) return 0;
    for (;;) {
        int first = 1, r, found = 0;
        const unsigned char *key;
        Py_ssize_t n;
        double v = 0;
        while ((r = next_key(s, &first, &key, &n)) == 1) {
            if (KEY("logprob")) {
                if (found || finite_double(s, &v) < 0) return -1;
                found = 1;
            } else if (skip_value(s) < 0) {
                return -1;
            }
        }
        if (r < 0 || !found || buf_push(out, &v, sizeof v) < 0) return -1;
        if (eat(s, ',')) continue;
        if (eat(s, ']')) return 0;
        return -1;
    }
}

/* token_logprobs: [x, ...] -> doubles (a null among them: not the plain shape) */
static int plain_logprobs(Scan *s, Buf *out) {
    if (!eat(s, '[')) return -1;
    if (eat(s, ']')) return 0;
    for (;;) {
        double v;
        if (finite_double(s, &v) < 0 || buf_push(out, &v, sizeof v) < 0) return -1;
        if (eat(s, ',')) continue;
        if (eat(s, ']')) return 0;
        return -1;
    }
}

/* A choice's "logprobs": null -> None; {"content": [...]} or {"token_logprobs": [...]} -> array('d');
   content wins where both are there (as the Python reader). */
static PyObject *choice_logprobs(Scan *s) {
    if (is_null(s)) Py_RETURN_NONE;
    Buf content = {0}, plain = {0};
    int first = 1, r, seen = 0, has_content = 0, has_plain = 0;
    const unsigned char *key;
    Py_ssize_t n;
    PyObject *out = NULL;
    while ((r = next_key(s, &first, &key, &n)) == 1) {
        if (KEY("content")) {
            ONCE(1);
            if (!is_null(s)) {
                if (logprob_entries(s, &content) < 0) goto fail;
                has_content = 1;
            }
        } else if (KEY("token_logprobs")) {
            ONCE(2);
            if (!is_null(s)) {
                if (plain_logprobs(s, &plain) < 0) goto fail;
                has_plain = 1;
            }
        } else if (skip_value(s) < 0) {
            goto fail;
        }
    }
    if (r < 0) goto fail;
    if (has_content) out = buf_array(&content, "d");
    else if (has_plain) out = buf_array(&plain, "d");
    else out = Py_NewRef(Py_None);
fail:
    PyMem_Free(content.data);
    PyMem_Free(plain.data);
    return out;
}

/* A chat message: only its tool_calls, as their JSON text (a list of objects) or None. */
static int message(Scan *s, PyObject **tools) {
    *tools = Py_NewRef(Py_None);
    if (is_null(s)) return 0;
    int first = 1, r, seen = 0;
    const unsigned char *key;
    Py_ssize_t n;
    while ((r = next_key(s, &first, &key, &n)) == 1) {
        if (KEY("tool_calls")) {
            ONCE(1);
            if (is_null(s)) continue;
            ws(s);
            const unsigned char *a = s->p;
            if (s->p >= s->end || *s->p != '[') goto fail;
            /* each element an object */
            s->p++;
            if (!eat(s, ']')) {
                for (;;) {
                    ws(s);
                    if (s->p >= s->end || *s->p != '{' || skip_value(s) < 0) goto fail;
                    if (eat(s, ',')) continue;
                    if (eat(s, ']')) break;
                    goto fail;
                }
            }
            Py_SETREF(*tools, PyBytes_FromStringAndSize((const char *)a, s->p - a));
            if (!*tools) return -2;
        } else if (skip_value(s) < 0) {
            goto fail;
        }
    }
    if (r == 0) return 0;
fail:
    return -1;
}

/* One choice -> (index, finish_reason, tool_calls JSON, token_ids, prompt_token_ids, logprobs). */
static PyObject *choice(Scan *s) {
    PyObject *finish = Py_NewRef(Py_None), *tools = Py_NewRef(Py_None), *ids = Py_NewRef(Py_None);
    PyObject *prompt = Py_NewRef(Py_None), *lps = Py_NewRef(Py_None), *out = NULL;
    long long index = 0;
    int first = 1, r, seen = 0;
    const unsigned char *key;
    Py_ssize_t n;
    while ((r = next_key(s, &first, &key, &n)) == 1) {
        if (KEY("index")) {
            ONCE(1);
            if (int_in(s, -INT64_MAX, INT64_MAX, &index) < 0) goto fail;
        } else if (KEY("finish_reason")) {
            ONCE(2);
            Py_XSETREF(finish, str_or_null(s));
            if (!finish) goto fail;
        } else if (KEY("message")) {
            ONCE(4);
            Py_CLEAR(tools);
            if (message(s, &tools) < 0) goto fail;
        } else if (KEY("token_ids")) {
            ONCE(8);
            Py_XSETREF(ids, ids_or_null(s));
            if (!ids) goto fail;
        } else if (KEY("prompt_token_ids")) {
            ONCE(16);
            Py_XSETREF(prompt, ids_or_null(s));
            if (!prompt) goto fail;
        } else if (KEY("logprobs")) {
            ONCE(32);
            Py_XSETREF(lps, choice_logprobs(s));
            if (!lps) goto fail;
        } else if (skip_value(s) < 0) {
            goto fail;
        }
    }
    if (r == 0) out = Py_BuildValue("(LOOOOO)", index, finish, tools, ids, prompt, lps);
fail:
    Py_XDECREF(finish);
    Py_XDECREF(tools);
    Py_XDECREF(ids);
    Py_XDECREF(prompt);
    Py_XDECREF(lps);
    return out;
}

static int usage(Scan *s, PyObject **prompt_tokens, PyObject **completion_tokens) {
    if (is_null(s)) return 0;
    int first = 1, r, seen = 0;
    const unsigned char *key;
    Py_ssize_t n;
    while ((r = next_key(s, &first, &key, &n)) == 1) {
        PyObject **slot = NULL;
        if (KEY("prompt_tokens")) {
            ONCE(1);
            slot = prompt_tokens;
        } else if (KEY("completion_tokens")) {
            ONCE(2);
            slot = completion_tokens;
        } else {
            if (skip_value(s) < 0) goto fail;
            continue;
        }
        Py_XSETREF(*slot, int_or_null(s));
        if (!*slot) goto fail;
    }
    if (r == 0) return 0;
fail:
    return -1;
}

/* scan(body: any bytes-like object) -> (prompt_token_ids, policy_version, spliced_tokens, model, prompt_tokens,
                  completion_tokens, choices) or None; a key that is absent reads as null. */
static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Scan sc = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len, 0};
    Scan *s = &sc;
    PyObject *prompt = Py_NewRef(Py_None), *version = Py_NewRef(Py_None), *spliced = Py_NewRef(Py_None);
    PyObject *model = Py_NewRef(Py_None), *pt = Py_NewRef(Py_None), *ct = Py_NewRef(Py_None);
    PyObject *choices = NULL, *out = NULL;
    int first = 1, r, seen = 0;
    const unsigned char *key;
    Py_ssize_t n;
    while ((r = next_key(s, &first, &key, &n)) == 1) {
        if (KEY("choices")) {
            ONCE(1);
            choices = PyList_New(0);
            if (!choices) goto error;
            if (!eat(s, '[')) goto fail;
            if (!eat(s, ']')) {
                for (;;) {
                    PyObject *c = choice(s);
                    if (!c) goto fail;
                    int bad = PyList_Append(choices, c);
                    Py_DECREF(c);
                    if (bad) goto error;
                    if (eat(s, ',')) continue;
                    if (eat(s, ']')) break;
                    goto fail;
                }
            }
        } else if (KEY("prompt_token_ids")) {
            ONCE(2);
            Py_XSETREF(prompt, ids_or_null(s));
            if (!prompt) goto fail;
        } else if (KEY("policy_version")) {
            ONCE(4);
            Py_XSETREF(version, int_or_null(s));
            if (!version) goto fail;
        } else if (KEY("spliced_tokens")) {
            ONCE(8);
            Py_XSETREF(spliced, int_or_null(s));
            if (!spliced) goto fail;
        } else if (KEY("model")) {
            ONCE(16);
            Py_XSETREF(model, str_or_null(s));
            if (!model) goto fail;
        } else if (KEY("usage")) {
            ONCE(32);
            if (usage(s, &pt, &ct) < 0) goto fail;
        } else if (KEY("error")) {
            ONCE(64);
            if (!is_null(s)) goto fail; /* an error body: the Python readers word it */
        } else if (KEY("object")) {
            ONCE(128);
            PyObject *obj = str_or_null(s);
            if (!obj) goto fail;
            int is_error = PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, "error") == 0;
            Py_DECREF(obj);
            if (is_error) goto fail;
        } else if (skip_value(s) < 0) {
            goto fail;
        }
    }
    ws(s);
    if (r != 0 || s->p != s->end || !choices) goto fail;
    out = Py_BuildValue("(OOOOOOO)", prompt, version, spliced, model, pt, ct, choices);
    goto error;
fail:
    if (PyErr_Occurred()) goto error;  /* out of memory: raise it */
    out = Py_NewRef(Py_None);
error:
    PyBuffer_Release(&view);
    Py_XDECREF(prompt);
    Py_XDECREF(version);
    Py_XDECREF(spliced);
    Py_XDECREF(model);
    Py_XDECREF(pt);
    Py_XDECREF(ct);
    Py_XDECREF(choices);
    return out;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, "The columns of a plain chat/completions response body, or None (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *m) {
    PyObject *array = PyImport_ImportModule("array");
    if (!array) return -1;
    ArrayType = PyObject_GetAttrString(array, "array");
    Py_DECREF(array);
    if (!ArrayType) return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {{Py_mod_exec, exec_module}, {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_openai_scan", "The compiled reader of plain OpenAI response bodies.", 0, methods, slots,
};

PyMODINIT_FUNC PyInit__openai_scan(void) { return PyModuleDef_Init(&module); }
