/* Nesting of CPU events in one pass: each event's parent, depth and self time (rows bucketed
 * by thread, sorted, then a stack per thread), and each event's innermost enclosing event of
 * a kind (memoized climbs up the parents), and the innermost event containing given moments
 * (a galloping search of the thread's order and a climb, per moment), and the tops of the
 * ops' call chains and the outermost enclosing event of a kind (a marking climb, then
 * memoized climbs answering the path from its top down).
 *
 * Why: structure.nest_sorted and structure.propagate answer the same questions with numpy
 * (binary lifting over ~18 full passes; one pass per nesting level), which was the largest
 * part of preparing a large trace and of attributing it to layers; these are O(n) (the sort
 * O(n log n), close to linear on a trace's nearly sorted rows). structure uses them where
 * built and its numpy code otherwise (tests/test_scan.py and tests/test_nesting.py compare
 * the two).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

PyDoc_STRVAR(propagate_doc,
             "propagate(parent, is_anchor, out)\n\n"
             "Fill out (int64) with the row of each row's innermost enclosing anchor, itself\n"
             "included, following parent (int64, -1 at the top), else -1; is_anchor: bool.");

/* propagate's work on checked buffers of n rows; path (n rows) and known (n, zeroed) are
 * its scratch. */
static void propagate_rows(const int64_t *up, const uint8_t *is_anchor, int64_t *found, Py_ssize_t n,
                           int64_t *path, uint8_t *known) {
    for (Py_ssize_t i = 0; i < n; i++) {
        /* climb to an anchor, a row already answered, or the top; then answer the path */
        Py_ssize_t len = 0;
        int64_t j = i;
        while (j >= 0 && j < n && !known[j] && !is_anchor[j] && len < n) {
            path[len++] = j;
            j = up[j];
        }
        int64_t value = (j < 0 || j >= n || len >= n) ? -1 : is_anchor[j] ? j : found[j];
        if (j >= 0 && j < n && is_anchor[j]) {
            found[j] = j;
            known[j] = 1;
        }
        while (len > 0) {
            int64_t k = path[--len];
            found[k] = value;
            known[k] = 1;
        }
    }
}

static PyObject *propagate(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, anchor, out;
    if (!PyArg_ParseTuple(args, "y*y*w*", &parent, &anchor, &out)) return NULL;
    Py_ssize_t n = parent.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    int64_t *path = NULL;
    uint8_t *known = NULL;
    if (anchor.len != n || out.len != n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "propagate: buffers of different lengths");
        goto done;
    }
    path = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    known = calloc((size_t)(n ? n : 1), 1);
    if (path == NULL || known == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    propagate_rows(parent.buf, anchor.buf, out.buf, n, path, known);
    result = Py_NewRef(Py_None);
done:
    free(path);
    free(known);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&anchor);
    PyBuffer_Release(&out);
    return result;
}

/* ---- nest_rows: the whole nesting of a table's CPU rows in one call ---- */

/* Order of starts and of negated durations as numpy sorts them: NaN last, NaNs equal. */
static inline int cmp_nan_last(double a, double b) {
    if (a != a) return b != b ? 0 : 1;
    if (b != b) return -1;
    return a < b ? -1 : a > b ? 1 : 0;
}

/* Whether row a goes after row b within a thread: by start, then longest first (-dur);
 * equal ones keep row order (the sort is stable and rows come in table order). */
static inline int row_after(const double *ts, const double *dur, int64_t a, int64_t b) {
    int c = cmp_nan_last(ts[a], ts[b]);
    if (c == 0) c = cmp_nan_last(-dur[a], -dur[b]);
    return c > 0;
}

/* Stable natural merge sort of rows[0..n) by row_after: the ascending runs found, then
 * merged pairwise, so rows nearly in order (a trace's, in file order) cost a pass or two,
 * and any order O(n log n). tmp: n scratch; bounds: n + 1 scratch. */
static void sort_rows(int64_t *rows, int64_t *tmp, Py_ssize_t *bounds, Py_ssize_t n, const double *ts,
                      const double *dur) {
    Py_ssize_t runs = 0;
    bounds[runs++] = 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (row_after(ts, dur, rows[i - 1], rows[i])) bounds[runs++] = i;
    bounds[runs] = n;
    int64_t *src = rows, *dst = tmp;
    while (runs > 1) {
        Py_ssize_t merged = 0;
        for (Py_ssize_t k = 0; k < runs; k += 2) {
            Py_ssize_t lo = bounds[k];
            Py_ssize_t mid = bounds[k + 1 < runs ? k + 1 : runs];
            Py_ssize_t hi = bounds[k + 2 < runs ? k + 2 : runs];
            Py_ssize_t i = lo, j = mid, out = lo;
            while (i < mid && j < hi) dst[out++] = row_after(ts, dur, src[i], src[j]) ? src[j++] : src[i++];
            while (i < mid) dst[out++] = src[i++];
            while (j < hi) dst[out++] = src[j++];
            bounds[merged++] = lo;
        }
        bounds[merged] = n;
        runs = merged;
        int64_t *swap = src;
        src = dst;
        dst = swap;
    }
    if (src != rows) memcpy(rows, src, sizeof(int64_t) * (size_t)n);
}

/* The distinct thread keys met so far and each one's rows: a hash table that grows (no
 * limit on the number of threads but memory). */
typedef struct {
    int64_t *keys;          /* the distinct keys, in order of discovery */
    Py_ssize_t *rows;       /* the number of rows of each */
    Py_ssize_t *slots;      /* open addressing: 1 + an index into keys, 0 where free */
    Py_ssize_t count, room; /* keys held and room for them; slots has 2 * room entries */
} KeySet;

static int keyset_init(KeySet *set) {
    set->count = 0;
    set->room = 64;
    set->keys = malloc(sizeof(int64_t) * (size_t)set->room);
    set->rows = malloc(sizeof(Py_ssize_t) * (size_t)set->room);
    set->slots = calloc((size_t)set->room * 2, sizeof(Py_ssize_t));
    return set->keys != NULL && set->rows != NULL && set->slots != NULL ? 0 : -1;
}

static void keyset_free(KeySet *set) {
    free(set->keys);
    free(set->rows);
    free(set->slots);
}

/* The slot holding key, or the free one where it goes (slots are at most half full). */
static Py_ssize_t *keyset_slot(const KeySet *set, int64_t key) {
    size_t mask = (size_t)set->room * 2 - 1;
    uint64_t h = (uint64_t)key; /* splitmix64's finalizer: keys differ in few bits */
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9u;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebu;
    size_t at = (size_t)(h ^ (h >> 31)) & mask;
    while (set->slots[at] != 0 && set->keys[set->slots[at] - 1] != key) at = (at + 1) & mask;
    return &set->slots[at];
}

/* Twice the room; -1 where it cannot be had (what the set holds is unchanged then). */
static int keyset_grow(KeySet *set) {
    if (set->room > PY_SSIZE_T_MAX / 4 / (Py_ssize_t)sizeof(int64_t)) return -1;
    Py_ssize_t room = set->room * 2;
    int64_t *keys = realloc(set->keys, sizeof(int64_t) * (size_t)room);
    if (keys == NULL) return -1;
    set->keys = keys;
    Py_ssize_t *rows = realloc(set->rows, sizeof(Py_ssize_t) * (size_t)room);
    if (rows == NULL) return -1;
    set->rows = rows;
    Py_ssize_t *slots = calloc((size_t)room * 2, sizeof(Py_ssize_t));
    if (slots == NULL) return -1;
    free(set->slots);
    set->slots = slots;
    set->room = room;
    for (Py_ssize_t k = 0; k < set->count; k++) *keyset_slot(set, keys[k]) = k + 1;
    return 0;
}

/* The index of key in the set, added (with no rows) where new; -1 out of memory. */
static Py_ssize_t keyset_index(KeySet *set, int64_t key) {
    Py_ssize_t *slot = keyset_slot(set, key);
    if (*slot != 0) return *slot - 1;
    if (set->count == set->room) {
        if (keyset_grow(set) < 0) return -1;
        slot = keyset_slot(set, key);
    }
    set->keys[set->count] = key;
    set->rows[set->count] = 0;
    *slot = ++set->count;
    return set->count - 1;
}

/* The keys of the set rows (on, n) and how many rows each has; rows of one thread mostly
 * follow each other, or alternate with another's, so the table is asked only where the key
 * is neither of the last two. 0, or -1 out of memory. */
static int count_keys(const uint8_t *on, const int64_t *key, Py_ssize_t n, KeySet *set) {
    Py_ssize_t last = -1, other = -1;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (!on[r]) continue;
        if (last < 0 || set->keys[last] != key[r]) {
            Py_ssize_t k = other >= 0 && set->keys[other] == key[r] ? other : keyset_index(set, key[r]);
            if (k < 0) return -1;
            other = last;
            last = k;
        }
        set->rows[last]++;
    }
    return 0;
}

static int cmp_int64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* per (count + 1 entries): where each key's rows start with the keys in ascending order,
 * then the end; fill (count): the same by order of discovery. 0 or -1 out of memory. */
static int place_keys(const KeySet *set, Py_ssize_t *per, Py_ssize_t *fill) {
    Py_ssize_t count = set->count;
    int64_t *sorted = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
    if (sorted == NULL) return -1;
    if (count > 0) memcpy(sorted, set->keys, sizeof(int64_t) * (size_t)count);
    qsort(sorted, (size_t)count, sizeof(int64_t), cmp_int64);
    for (Py_ssize_t k = 0; k < count; k++) { /* the rank of keys[k]: fill[k], for now */
        Py_ssize_t lo = 0, hi = count;
        while (lo < hi) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (sorted[mid] < set->keys[k])
                lo = mid + 1;
            else
                hi = mid;
        }
        fill[k] = lo;
        per[lo + 1] = set->rows[k];
    }
    free(sorted);
    per[0] = 0;
    for (Py_ssize_t k = 0; k < count; k++) per[k + 1] += per[k];
    for (Py_ssize_t k = 0; k < count; k++) fill[k] = per[fill[k]];
    return 0;
}

/* The set rows (on, n) by key, ascending, each key's in table order, into ordered; *per:
 * the first position of each key's rows (distinct + 1 entries; the caller frees it).
 * Returns the number of distinct keys, or -1 out of memory. */
static Py_ssize_t bucket_rows(const uint8_t *on, const int64_t *key, Py_ssize_t n, int64_t *ordered,
                              Py_ssize_t **per_out) {
    KeySet set;
    Py_ssize_t distinct = -1, *fill = NULL, *per = NULL;
    if (keyset_init(&set) < 0 || count_keys(on, key, n, &set) < 0) goto done;
    fill = malloc(sizeof(Py_ssize_t) * (size_t)(set.count ? set.count : 1));
    per = malloc(sizeof(Py_ssize_t) * ((size_t)set.count + 1));
    if (fill == NULL || per == NULL || place_keys(&set, per, fill) < 0) goto done;
    for (Py_ssize_t r = 0, last = -1, other = -1; r < n; r++) {
        if (!on[r]) continue;
        if (last < 0 || set.keys[last] != key[r]) { /* (as count_keys; every key is in the set now) */
            Py_ssize_t k = other >= 0 && set.keys[other] == key[r] ? other : *keyset_slot(&set, key[r]) - 1;
            other = last;
            last = k;
        }
        ordered[fill[last]++] = r;
    }
    *per_out = per;
    per = NULL;
    distinct = set.count;
done:
    keyset_free(&set);
    free(fill);
    free(per);
    return distinct;
}

/* The walk over the m rows of ordered (sorted by key, start, longest first): each row's
 * parent, the nearest earlier row of its thread that encloses it (one that starts with it,
 * or ends at most tolerance after it ends and at least margin after it starts; else -1),
 * and depth by row, and each row's children's durations summed in child (by row, zeroed
 * at the walked rows) in that order; ends and stack: m + 1 scratch each. The stack holds the open
 * rows' positions, ends their end times (as ts - t0 + dur, the same sums), so a row's
 * depth is the stack's height and no closed row is read again. */
static void walk_rows(const int64_t *ordered, Py_ssize_t m, const int64_t *key, const double *ts, const double *dur,
                      double t0, double tolerance, double margin, int64_t *up, int32_t *level, double *child,
                      double *ends, int64_t *stack) {
    Py_ssize_t top = 0;
    int64_t last_key = 0;
    double last_start = 0.0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = ordered[i];
        double s = ts[r] - t0;
        double e = s + dur[r];
        int same_thread = i > 0 && key[r] == last_key;
        if (!same_thread) top = 0;
        if (!(same_thread && s == last_start)) {
            double target = e - tolerance;
            if (s + margin > target) target = s + margin;
            while (top > 0 && !(ends[top - 1] >= target)) top--;
        }
        if (top > 0) {
            int64_t p = ordered[stack[top - 1]];
            up[r] = p;
            child[p] += dur[r];
        }
        level[r] = (int32_t)top;
        stack[top] = i;
        ends[top++] = e;
        last_key = key[r];
        last_start = s;
    }
}

/* The set rows (on, n) by (key, start, longest first) into ordered (one per set row), as
 * nest_rows orders them; tmp (as many entries as set rows) and bounds (one more) are the
 * sort's scratch. 0 done, -1 out of memory. */
static int order_checked(const uint8_t *on, const int64_t *key, const double *ts, const double *dur, Py_ssize_t n,
                         int64_t *ordered, int64_t *tmp, Py_ssize_t *bounds) {
    Py_ssize_t *per = NULL;
    Py_ssize_t distinct = bucket_rows(on, key, n, ordered, &per);
    if (distinct < 0) return -1;
    for (Py_ssize_t k = 0; k < distinct; k++) /* each thread's rows by (start, longest first) */
        sort_rows(ordered + per[k], tmp, bounds, per[k + 1] - per[k], ts, dur);
    free(per);
    return 0;
}

PyDoc_STRVAR(nest_rows_doc,
             "nest_rows(mask, keys, ts, dur, t0, tolerance, margin, ordered, parent, depth, self_dur)\n\n"
             "structure.nest in one call: the rows where mask (uint8, n) is set, sorted by (keys,\n"
             "ts, -dur) as numpy's stable lexsort does (NaN last), into ordered (int64, one per set\n"
             "row); for those rows parent (int64, a row number: the nearest earlier row of the same\n"
             "key that encloses it, as structure.previous_enclosing says), depth (int32) and self_dur\n"
             "(float64: dur less the children's durations summed in that order, at least +0.0, NaN\n"
             "kept, as np.maximum gives it), from starts ts - t0; -1, -1 and dur elsewhere. Any number\n"
             "of distinct keys.");

/* nest_rows on checked buffers: 0 done, -1 out of memory. */
static int nest_rows_checked(const uint8_t *on, const int64_t *key, const double *ts, const double *dur, double t0,
                             double tolerance, double margin, Py_ssize_t n, int64_t *ordered, Py_ssize_t m,
                             int64_t *up, int32_t *level, double *self_dur) {
    int status = -1;
    int64_t *tmp = malloc(sizeof(int64_t) * (size_t)(m + 1)); /* the sort's scratch, then the walk's ends */
    int64_t *stack = malloc(sizeof(int64_t) * (size_t)(m + 1)); /* also the sort's run bounds */
    if (tmp == NULL || stack == NULL) goto done;
    if (order_checked(on, key, ts, dur, n, ordered, tmp, (Py_ssize_t *)stack) < 0) goto done;
    for (Py_ssize_t r = 0; r < n; r++) {
        up[r] = -1;
        level[r] = -1;
        self_dur[r] = dur[r];
    }
    /* self_dur holds the walked rows' children's durations summed (from +0.0), then their own */
    for (Py_ssize_t i = 0; i < m; i++) self_dur[ordered[i]] = 0.0;
    walk_rows(ordered, m, key, ts, dur, t0, tolerance, margin, up, level, self_dur, (double *)tmp, stack);
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = ordered[i];
        double own = dur[r] - self_dur[r];
        /* np.maximum(own, 0.0), branch-free: NaN kept, and -0.0 + 0.0 is +0.0 */
        self_dur[r] = (own < 0.0 ? 0.0 : own) + 0.0;
    }
    status = 0;
done:
    free(tmp);
    free(stack);
    return status;
}

/* Whether nest_rows' and order_rows' common buffers fit: keys (int64), ts and dur (double)
 * one per row of mask (uint8), and ordered (int64) one per row set in it. */
static int rows_fit(const Py_buffer *mask, const Py_buffer *keys, const Py_buffer *tsb, const Py_buffer *durb,
                    const Py_buffer *ordb) {
    Py_ssize_t n = mask->len;
    Py_ssize_t count = 0;
    for (Py_ssize_t r = 0; r < n; r++) count += ((const uint8_t *)mask->buf)[r] != 0;
    return keys->len == n * (Py_ssize_t)sizeof(int64_t) && tsb->len == n * (Py_ssize_t)sizeof(double) &&
           durb->len == n * (Py_ssize_t)sizeof(double) && ordb->len == count * (Py_ssize_t)sizeof(int64_t);
}

static PyObject *nest_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer mask, keys, tsb, durb, ordb, parb, depb, selfb;
    double t0, tolerance, margin;
    if (!PyArg_ParseTuple(args, "y*y*y*y*dddw*w*w*w*", &mask, &keys, &tsb, &durb, &t0, &tolerance, &margin, &ordb,
                          &parb, &depb, &selfb))
        return NULL;
    Py_ssize_t n = mask.len;
    Py_ssize_t m = ordb.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    if (!rows_fit(&mask, &keys, &tsb, &durb, &ordb) || parb.len != n * (Py_ssize_t)sizeof(int64_t) ||
        depb.len != n * (Py_ssize_t)sizeof(int32_t) || selfb.len != n * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "nest_rows: buffers of different lengths");
    } else {
        if (nest_rows_checked(mask.buf, keys.buf, tsb.buf, durb.buf, t0, tolerance, margin, n, ordb.buf, m, parb.buf,
                              depb.buf, selfb.buf) < 0)
            PyErr_NoMemory();
        else
            result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&mask);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&tsb);
    PyBuffer_Release(&durb);
    PyBuffer_Release(&ordb);
    PyBuffer_Release(&parb);
    PyBuffer_Release(&depb);
    PyBuffer_Release(&selfb);
    return result;
}

PyDoc_STRVAR(order_rows_doc,
             "order_rows(mask, keys, ts, dur, ordered)\n\n"
             "nest_rows' order alone: the rows where mask (uint8, n) is set, sorted by (keys, ts,\n"
             "-dur) as numpy's stable lexsort does (NaN last), into ordered (int64, one per set\n"
             "row); structure.cpu_by_thread where mask is its CPU duration events and keys the\n"
             "table's thread_keys (a trace reopened from its cache has no nesting walk to hand\n"
             "it over).");

/* The ascending runs of rows[0..n) in row_after's order, as sort_rows finds them. */
static Py_ssize_t count_runs(const int64_t *rows, Py_ssize_t n, const double *ts, const double *dur) {
    Py_ssize_t runs = n > 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (row_after(ts, dur, rows[i - 1], rows[i])) runs++;
    return runs;
}

/* order_checked with its scratch had only where a thread's rows are out of order, and
 * the run bounds only for the runs there are (a trace's rows come in few runs: no
 * table-long scratch to fault in for nothing). 0, -1 no memory. */
static int order_lazily(const uint8_t *on, const int64_t *key, const double *ts, const double *dur, Py_ssize_t n,
                        int64_t *ordered) {
    Py_ssize_t *per = NULL, *bounds = NULL, room = 0;
    int64_t *tmp = NULL;
    int status = -1;
    Py_ssize_t distinct = bucket_rows(on, key, n, ordered, &per);
    if (distinct < 0) return -1;
    for (Py_ssize_t k = 0; k < distinct; k++) {
        Py_ssize_t size = per[k + 1] - per[k];
        Py_ssize_t runs = count_runs(ordered + per[k], size, ts, dur);
        if (runs <= 1) continue;
        if (tmp == NULL) { /* (room for the largest thread: the whole set) */
            tmp = malloc(sizeof(int64_t) * (size_t)per[distinct]);
            if (tmp == NULL) goto done;
        }
        if (runs + 1 > room) {
            Py_ssize_t *grown = realloc(bounds, sizeof(Py_ssize_t) * (size_t)(runs + 1));
            if (grown == NULL) goto done;
            bounds = grown;
            room = runs + 1;
        }
        sort_rows(ordered + per[k], tmp, bounds, size, ts, dur); /* (finds the same runs) */
    }
    status = 0;
done:
    free(per);
    free(tmp);
    free(bounds);
    return status;
}

static PyObject *order_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer mask, keys, tsb, durb, ordb;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &mask, &keys, &tsb, &durb, &ordb)) return NULL;
    Py_ssize_t n = mask.len;
    PyObject *result = NULL;
    if (!rows_fit(&mask, &keys, &tsb, &durb, &ordb)) {
        PyErr_SetString(PyExc_ValueError, "order_rows: buffers of different lengths");
        goto done;
    }
    if (order_lazily(mask.buf, keys.buf, tsb.buf, durb.buf, n, ordb.buf) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&mask);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&tsb);
    PyBuffer_Release(&durb);
    PyBuffer_Release(&ordb);
    return result;
}

/* ---- enclosing_at: the innermost candidate event containing each moment ---- */

PyDoc_STRVAR(enclosing_at_doc,
             "enclosing_at(cand, wide, ts, dur, parent, t0, margin, moments, out)\n\n"
             "For each of moments (float64, taken from t0): the last of cand (rows: int64 where\n"
             "wide, else int32; their starts ts - t0 in numpy's sorted order) starting at or\n"
             "before it, climbed up parent\n"
             "while it ended (start + dur < moment + margin and start != moment); -1 where none.\n"
             "The values of _common.enclosing_at's numpy searchsorted and climb, in one pass.");

/* numpy's order of floats (NaN last): a < b */
static inline int less_nan_last(double a, double b) { return a < b || (b != b && a == a); }

/* Row i of cand: int64 rows where wide, else int32 (``structure.narrow_rows``). */
static inline int64_t cand_row(const void *cand, int wide, Py_ssize_t i) {
    return wide ? ((const int64_t *)cand)[i] : (int64_t)((const int32_t *)cand)[i];
}

/* The first i in [lo, m) with moment < start of cand[i] (numpy's order), else m. */
static Py_ssize_t first_after(const void *cand, int wide, const double *ts, double t0, double moment, Py_ssize_t lo,
                              Py_ssize_t m) {
    Py_ssize_t hi = m;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (less_nan_last(moment, ts[cand_row(cand, wide, mid)] - t0))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* enclosing_at's work on checked buffers (every cand row in [0, n)); -1 where a climb
 * leaves the table or does not end (a parent cycle), else 0. */
static int enclosing_rows(const void *cand, int wide, Py_ssize_t m, const double *ts, const double *dur,
                          const int64_t *parent, Py_ssize_t n, double t0, double margin, const double *moments,
                          Py_ssize_t k, int64_t *out) {
    Py_ssize_t hint = 0; /* the last answer: moments mostly come in time order */
    for (Py_ssize_t j = 0; j < k; j++) {
        double moment = moments[j];
        Py_ssize_t at;
        if (hint < m && !less_nan_last(moment, ts[cand_row(cand, wide, hint)] - t0)) {
            /* past the hint: gallop forward, then bisect the last step */
            Py_ssize_t lo = hint + 1, step = 1;
            while (lo < m && !less_nan_last(moment, ts[cand_row(cand, wide, lo)] - t0)) {
                hint = lo;
                lo = step < m - lo ? lo + step : m;
                step *= 2;
            }
            at = first_after(cand, wide, ts, t0, moment, hint + 1, lo < m ? lo : m);
        } else {
            at = first_after(cand, wide, ts, t0, moment, 0, hint < m ? hint : m);
        }
        hint = at > 0 ? at - 1 : 0;
        int64_t row = at > 0 ? cand_row(cand, wide, at - 1) : -1;
        for (Py_ssize_t climbed = 0; row >= 0; climbed++) {
            if (row >= n || climbed > n) return -1;
            double start = ts[row] - t0;
            if (!(start + dur[row] < moment + margin && start != moment)) break;
            row = parent[row];
        }
        out[j] = row;
    }
    return 0;
}

static PyObject *enclosing_at(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer candb, tsb, durb, parb, momb, outb;
    double t0, margin;
    int wide;
    if (!PyArg_ParseTuple(args, "y*py*y*y*ddy*w*", &candb, &wide, &tsb, &durb, &parb, &t0, &margin, &momb, &outb))
        return NULL;
    Py_ssize_t n = tsb.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t width = wide ? (Py_ssize_t)sizeof(int64_t) : (Py_ssize_t)sizeof(int32_t);
    Py_ssize_t m = candb.len / width;
    Py_ssize_t k = momb.len / (Py_ssize_t)sizeof(double);
    PyObject *result = NULL;
    if (tsb.len != n * (Py_ssize_t)sizeof(double) || durb.len != tsb.len ||
        parb.len != n * (Py_ssize_t)sizeof(int64_t) || candb.len != m * width ||
        momb.len != k * (Py_ssize_t)sizeof(double) || outb.len != k * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "enclosing_at: buffers of different lengths");
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t row = cand_row(candb.buf, wide, i);
        if (row < 0 || row >= n) {
            PyErr_SetString(PyExc_ValueError, "enclosing_at: a candidate row outside the table");
            goto done;
        }
    }
    if (enclosing_rows(candb.buf, wide, m, tsb.buf, durb.buf, parb.buf, n, t0, margin, momb.buf, k, outb.buf) < 0) {
        PyErr_SetString(PyExc_ValueError, "enclosing_at: a parent outside the table or a cycle of parents");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&candb);
    PyBuffer_Release(&tsb);
    PyBuffer_Release(&durb);
    PyBuffer_Release(&parb);
    PyBuffer_Release(&momb);
    PyBuffer_Release(&outb);
    return result;
}

/* ---- chain_tops: the top of each op's call chain (_common.call_chains) ---- */

PyDoc_STRVAR(chain_tops_doc,
             "chain_tops(parent, is_op, shaped, rows, out)\n\n"
             "For each of rows (int64): the outermost call-chain candidate enclosing it, itself\n"
             "included, following parent (int64, -1 at the top), else -1, into out (int64). A\n"
             "candidate is a shaped row, or an is_op row that neither is shaped nor holds one\n"
             "(bool masks). _common.call_chains' values (its numpy walk, then two propagates) in\n"
             "one call; parents outside the table end a climb, as in propagate.");

/* The outermost anchor enclosing each of rows (all n rows where rows is NULL), itself
 * included, following up (rows outside the table end a climb), else -1, into out; known
 * (n, zeroed) and found (n; out itself where rows is NULL) are its scratch, *path (*cap
 * entries) too, grown as a climb needs (a nest's depth, not a table's length). Climbs to a
 * row already answered or the top, then answers the path from its top down: the outermost
 * anchor so far, else the row itself where it is one. -1 where no memory, else 0. */
static int outermost_rows(const int64_t *up, const uint8_t *is_anchor, Py_ssize_t n, const int64_t *rows,
                          Py_ssize_t k, int64_t *out, uint8_t *known, int64_t *found, int64_t **path,
                          Py_ssize_t *cap) {
    for (Py_ssize_t r = 0; r < k; r++) {
        int64_t i = rows ? rows[r] : (int64_t)r;
        Py_ssize_t len = 0;
        int64_t j = i;
        while (j >= 0 && j < n && !known[j] && len < n) {
            if (len == *cap) {
                Py_ssize_t more = *cap < n / 2 ? *cap * 2 : n;
                int64_t *grown = realloc(*path, sizeof(int64_t) * (size_t)more);
                if (grown == NULL) return -1;
                *path = grown;
                *cap = more;
            }
            (*path)[len++] = j;
            j = up[j];
        }
        int64_t value = (j >= 0 && j < n && known[j]) ? found[j] : -1;
        while (len > 0) {
            int64_t q = (*path)[--len];
            if (value < 0 && is_anchor[q]) value = q;
            found[q] = value;
            known[q] = 1;
        }
        out[r] = value;
    }
    return 0;
}

/* The first room of outermost_rows' path: most nests are shallow. */
#define PATH_START 256

/* chain_tops' work on checked buffers; cand (n, zeroed), known (n, zeroed), found (n) and
 * path (*cap, grown) are its scratch; -1 where no memory, else 0. */
static int chain_tops_rows(const int64_t *up, const uint8_t *is_op, const uint8_t *shaped, Py_ssize_t n,
                           const int64_t *rows, Py_ssize_t k, int64_t *out, uint8_t *cand, uint8_t *known,
                           int64_t *found, int64_t **path, Py_ssize_t *cap) {
    /* the rows that are shaped or hold one (marked 1): marking stops at a marked row (so at a cycle) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!shaped[i]) continue;
        for (int64_t j = i; j >= 0 && j < n && !cand[j]; j = up[j]) cand[j] = 1;
    }
    /* the candidates: shaped, or ops holding none */
    for (Py_ssize_t i = 0; i < n; i++) cand[i] = shaped[i] || (is_op[i] && !cand[i]);
    return outermost_rows(up, cand, n, rows, k, out, known, found, path, cap);
}

static PyObject *chain_tops(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, op, shaped, rowsb, outb;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &parent, &op, &shaped, &rowsb, &outb)) return NULL;
    Py_ssize_t n = parent.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t k = rowsb.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *rows = rowsb.buf;
    PyObject *result = NULL;
    uint8_t *cand = NULL, *known = NULL;
    int64_t *found = NULL, *path = NULL;
    if (parent.len != n * (Py_ssize_t)sizeof(int64_t) || op.len != n || shaped.len != n ||
        rowsb.len != k * (Py_ssize_t)sizeof(int64_t) || outb.len != rowsb.len) {
        PyErr_SetString(PyExc_ValueError, "chain_tops: buffers of different lengths");
        goto done;
    }
    for (Py_ssize_t r = 0; r < k; r++) {
        if (rows[r] < 0 || rows[r] >= n) {
            PyErr_SetString(PyExc_ValueError, "chain_tops: a row outside the table");
            goto done;
        }
    }
    cand = calloc((size_t)(n ? n : 1), 1);
    known = calloc((size_t)(n ? n : 1), 1);
    found = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    Py_ssize_t cap = PATH_START;
    path = malloc(sizeof(int64_t) * (size_t)cap);
    if (cand == NULL || known == NULL || found == NULL || path == NULL ||
        chain_tops_rows(parent.buf, op.buf, shaped.buf, n, rows, k, outb.buf, cand, known, found, &path, &cap) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(cand);
    free(known);
    free(found);
    free(path);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&op);
    PyBuffer_Release(&shaped);
    PyBuffer_Release(&rowsb);
    PyBuffer_Release(&outb);
    return result;
}

PyDoc_STRVAR(outermost_doc,
             "outermost(parent, is_anchor, out)\n\n"
             "Fill out (int64) with the row of each row's outermost enclosing anchor, itself\n"
             "included, following parent (int64, -1 at the top), else -1; is_anchor: bool.\n"
             "Parents outside the table end a climb, as in propagate.");

static PyObject *outermost(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer parent, anchor, outb;
    if (!PyArg_ParseTuple(args, "y*y*w*", &parent, &anchor, &outb)) return NULL;
    Py_ssize_t n = parent.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    uint8_t *known = NULL;
    int64_t *path = NULL;
    if (parent.len != n * (Py_ssize_t)sizeof(int64_t) || anchor.len != n || outb.len != parent.len) {
        PyErr_SetString(PyExc_ValueError, "outermost: buffers of different lengths");
        goto done;
    }
    known = calloc((size_t)(n ? n : 1), 1);
    Py_ssize_t cap = PATH_START;
    path = malloc(sizeof(int64_t) * (size_t)cap);
    if (known == NULL || path == NULL ||
        outermost_rows(parent.buf, anchor.buf, n, NULL, n, outb.buf, known, outb.buf, &path, &cap) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(known);
    free(path);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&anchor);
    PyBuffer_Release(&outb);
    return result;
}

/* ---- union_rows: the length of a union of intervals per group ---- */

PyDoc_STRVAR(union_rows_doc,
             "union_rows(group, wide, start, end, out) -> bool\n\n"
             "_common.union_length in one pass, for rows already in (group, start) order: out\n"
             "(float64, one per group, zeroed here) gets, per group, what each row [start, end)\n"
             "adds past the largest end of the group's earlier rows, summed in row order (rows\n"
             "with end <= start, NaN included, add nothing and are not looked at). group: int64\n"
             "where wide, else int32; start, end: float64. False (out of no meaning) where a\n"
             "looked-at row is out of that order, has a group outside out or an infinite time:\n"
             "the caller sorts them with numpy.");

/* union_rows' pass over rows already checked to be of one length: 1 done, 0 where a
 * looked-at row is out of order, outside out or infinite (out then of no meaning). */
static int union_pass(const void *groups_buf, int wide, const double *start, const double *end, Py_ssize_t m,
                      double *out, Py_ssize_t groups) {
    for (Py_ssize_t g = 0; g < groups; g++) out[g] = 0.0;
    int seen = 0;
    int64_t last = 0;
    double reach = 0.0, previous = 0.0; /* the group's largest end so far; the last start looked at */
    for (Py_ssize_t i = 0; i < m; i++) {
        double s = start[i], e = end[i];
        if (!(e > s)) continue; /* (an empty interval, or NaN) */
        int64_t g = wide ? ((const int64_t *)groups_buf)[i] : (int64_t)((const int32_t *)groups_buf)[i];
        if (g < 0 || g >= groups || s - s != 0.0 || e - e != 0.0 || (seen && (g < last || (g == last && s < previous))))
            return 0;
        int first = !seen || g != last; /* the group's first row adds all of itself */
        double added = first ? s : (s > reach ? s : reach);
        double w = e - added;
        out[g] += w > 0.0 ? w : 0.0;
        if (first || e > reach) reach = e;
        seen = 1;
        last = g;
        previous = s;
    }
    return 1;
}

static PyObject *union_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer gb, sb, eb, ob;
    int wide;
    if (!PyArg_ParseTuple(args, "y*py*y*w*", &gb, &wide, &sb, &eb, &ob)) return NULL;
    Py_ssize_t m = sb.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t groups = ob.len / (Py_ssize_t)sizeof(double);
    PyObject *result = NULL;
    if (sb.len != m * (Py_ssize_t)sizeof(double) || eb.len != sb.len || ob.len != groups * (Py_ssize_t)sizeof(double) ||
        gb.len != m * (Py_ssize_t)(wide ? sizeof(int64_t) : sizeof(int32_t))) {
        PyErr_SetString(PyExc_ValueError, "union_rows: buffers of different lengths");
    } else {
        result = PyBool_FromLong(union_pass(gb.buf, wide, sb.buf, eb.buf, m, ob.buf, groups));
    }
    PyBuffer_Release(&gb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&eb);
    PyBuffer_Release(&ob);
    return result;
}

/* ---- window_parts: each row's part inside the one window it reaches into ---- */

PyDoc_STRVAR(window_parts_doc,
             "window_parts(start, end, win_start, win_end, win_dur, where, group, since, until) -> int\n\n"
             "steps._in_one_window and steps._clipped in one pass: for rows (start, end: float64,\n"
             "start ascending) and one rank's windows (win_start, win_end, win_dur: float64, the\n"
             "frame's; where: int64, the rank's windows in it, by start), each row's window is the\n"
             "first of where ending after its start; a row reaching into it (the window starts\n"
             "before the row ends) gets a part: group (int32) the window, since and until (float64)\n"
             "its start and end from the window's start, clipped to [0, win_dur] as np.clip does.\n"
             "Parts are written in row order; returns their number, or -1 where a time is NaN, rows\n"
             "or windows are out of order, or a row reaches into two windows (the caller's numpy\n"
             "search does those).");

/* Whether the w windows at where are in the frame (of frame windows), known (no NaN) and
 * in order of start and of end. */
static int windows_ok(const int64_t *where, Py_ssize_t w, Py_ssize_t frame, const double *ws, const double *we,
                      const double *wd) {
    for (Py_ssize_t j = 0; j < w; j++) {
        int64_t g = where[j];
        if (g < 0 || g >= frame || g > INT32_MAX) return 0;
        if (ws[g] != ws[g] || we[g] != we[g] || wd[g] != wd[g]) return 0;
        if (j > 0 && (we[g] < we[where[j - 1]] || ws[g] < ws[where[j - 1]])) return 0;
    }
    return 1;
}

/* x clipped to [0, length] as np.clip does: min(max(x, 0), length), as numpy's loop. */
static inline double clipped(double x, double length) {
    x = x > 0.0 ? x : 0.0;
    return x < length ? x : length;
}

/* window_parts' pass over the m rows (windows checked by windows_ok): the number of parts
 * written, or -1 (see window_parts). */
static Py_ssize_t parts_pass(const double *start, const double *end, Py_ssize_t m, const int64_t *where, Py_ssize_t w,
                             const double *ws, const double *we, const double *wd, int32_t *group, double *since,
                             double *until) {
    Py_ssize_t lo = 0, count = 0; /* lo: the windows ending by the row's start */
    for (Py_ssize_t i = 0; i < m; i++) {
        double s = start[i], e = end[i];
        if (s != s || e != e || (i > 0 && s < start[i - 1])) return -1;
        while (lo < w && !(s < we[where[lo]])) lo++; /* (searchsorted(win_end, start, 'right')) */
        if (lo == w || !(ws[where[lo]] < e)) continue; /* in no window */
        if (lo + 1 < w && ws[where[lo + 1]] < e) return -1; /* into the next one too */
        int64_t g = where[lo];
        group[count] = (int32_t)g;
        since[count] = clipped(s - ws[g], wd[g]);
        until[count] = clipped(e - ws[g], wd[g]);
        count++;
    }
    return count;
}

static PyObject *window_parts(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer sb, eb, wsb, web, wdb, whb, gb, ab, ub;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*w*w*w*", &sb, &eb, &wsb, &web, &wdb, &whb, &gb, &ab, &ub)) return NULL;
    Py_ssize_t m = sb.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t frame = wsb.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t w = whb.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    int same = sb.len == m * (Py_ssize_t)sizeof(double) && eb.len == sb.len &&
               wsb.len == frame * (Py_ssize_t)sizeof(double) && web.len == wsb.len && wdb.len == wsb.len;
    same = same && whb.len == w * (Py_ssize_t)sizeof(int64_t) && gb.len == m * (Py_ssize_t)sizeof(int32_t) &&
           ab.len == sb.len && ub.len == sb.len;
    if (!same) {
        PyErr_SetString(PyExc_ValueError, "window_parts: buffers of different lengths");
    } else if (!windows_ok(whb.buf, w, frame, wsb.buf, web.buf, wdb.buf)) {
        result = PyLong_FromSsize_t(-1);
    } else {
        result = PyLong_FromSsize_t(
            parts_pass(sb.buf, eb.buf, m, whb.buf, w, wsb.buf, web.buf, wdb.buf, gb.buf, ab.buf, ub.buf));
    }
    PyBuffer_Release(&sb);
    PyBuffer_Release(&eb);
    PyBuffer_Release(&wsb);
    PyBuffer_Release(&web);
    PyBuffer_Release(&wdb);
    PyBuffer_Release(&whb);
    PyBuffer_Release(&gb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&ub);
    return result;
}

/* ---- group_sums: pandas' compensated sums per group ---- */

PyDoc_STRVAR(group_sums_doc,
             "group_sums(group, values, out) -> bool\n\n"
             "out (float64, one per group, zeroed here) gets the sum of values (float64) per group\n"
             "(group: int64, one per value), NaN left out, each group's values added in row\n"
             "order with the compensation (Kahan) pandas' groupby().sum() uses, so that the sums\n"
             "are its own to the bit. False (out of no meaning) where a group is outside out or a\n"
             "sum is not finite: the caller asks pandas.");

static PyObject *group_sums(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer gb, vb, ob;
    if (!PyArg_ParseTuple(args, "y*y*w*", &gb, &vb, &ob)) return NULL;
    Py_ssize_t m = vb.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t groups = ob.len / (Py_ssize_t)sizeof(double);
    PyObject *result = NULL;
    double *compensation = NULL;
    if (vb.len != m * (Py_ssize_t)sizeof(double) || gb.len != m * (Py_ssize_t)sizeof(int64_t) ||
        ob.len != groups * (Py_ssize_t)sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "group_sums: buffers of different lengths");
        goto done;
    }
    compensation = calloc((size_t)(groups ? groups : 1), sizeof(double));
    if (compensation == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *group = gb.buf;
    const double *values = vb.buf;
    double *sum = ob.buf;
    for (Py_ssize_t g = 0; g < groups; g++) sum[g] = 0.0;
    int ok = 1;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t g = group[i];
        if (g < 0 || g >= groups) {
            ok = 0;
            break;
        }
        double value = values[i];
        if (value != value) continue; /* NaN: left out */
        double y = value - compensation[g];
        double t = sum[g] + y;
        double c = t - sum[g] - y;
        compensation[g] = c - c == 0.0 ? c : 0.0; /* not finite (an infinite value): no compensation */
        sum[g] = t;
    }
    for (Py_ssize_t g = 0; ok && g < groups; g++)
        if (sum[g] - sum[g] != 0.0) ok = 0;
    result = PyBool_FromLong(ok);
done:
    free(compensation);
    PyBuffer_Release(&gb);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&ob);
    return result;
}

/* ---- propagate_pair: two propagations over the nesting walk's order ---- */

PyDoc_STRVAR(propagate_pair_doc,
             "propagate_pair(ordered, wide, parent, is_a, is_b, outer, out_a, out_b) -> bool\n\n"
             "propagate(parent, is_a, out_a) and propagate(parent, is_b, out_b) in two passes (with\n"
             "outer: each row's outermost enclosing anchor, itself included, as outermost gives),\n"
             "for a nest_rows order ordered (int64 where wide, else int32): every row with a\n"
             "parent (int64, -1 at the top) is in ordered, after its parent, so each row\n"
             "inherits its parent's answer, final by then. False (outs of no meaning) where that\n"
             "does not hold (a row twice in ordered or outside the table, a parent after its\n"
             "child or outside the table, a row with a parent missing from ordered): the caller\n"
             "climbs instead. is_b and out_b may be empty: one propagation.");

/* A row's answer from its parent's (final): the innermost anchor (itself where it is
 * one), or with outer the outermost (the parent's where it has one). */
static inline int64_t inherited(int64_t own, int64_t above, uint8_t anchor, int outer) {
    if (outer) return above >= 0 ? above : own;
    return anchor ? own : above;
}

/* propagate_pair's work on checked buffers; seen (n, zeroed) is its scratch. 1 done, 0
 * where the order does not hold. */
static int pair_pass(const void *ordered, int wide, Py_ssize_t m, const int64_t *up, const uint8_t *is_a,
                     const uint8_t *is_b, int outer, int64_t *out_a, int64_t *out_b, Py_ssize_t n, uint8_t *seen) {
    Py_ssize_t with_parent = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out_a[i] = is_a[i] ? i : -1;
        if (out_b) out_b[i] = is_b[i] ? i : -1;
        with_parent += up[i] >= 0;
    }
    for (Py_ssize_t r = 0; r < m; r++) {
        int64_t i = cand_row(ordered, wide, r);
        if (i < 0 || i >= n || seen[i]) return 0;
        seen[i] = 1;
        int64_t p = up[i];
        if (p < 0) continue;
        if (p >= n || !seen[p]) return 0;
        with_parent--;
        out_a[i] = inherited(out_a[i], out_a[p], is_a[i], outer);
        if (out_b) out_b[i] = inherited(out_b[i], out_b[p], is_b[i], outer);
    }
    return with_parent == 0;
}

static PyObject *propagate_pair(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer ob, parent, a, b, oa, obb;
    int wide, outer;
    if (!PyArg_ParseTuple(args, "y*py*y*y*pw*w*", &ob, &wide, &parent, &a, &b, &outer, &oa, &obb)) return NULL;
    Py_ssize_t n = parent.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t width = wide ? (Py_ssize_t)sizeof(int64_t) : (Py_ssize_t)sizeof(int32_t);
    PyObject *result = NULL;
    uint8_t *seen = NULL;
    int one = b.len == 0 && obb.len == 0; /* no second propagation */
    if (parent.len != n * (Py_ssize_t)sizeof(int64_t) || a.len != n || oa.len != parent.len || ob.len % width ||
        (!one && (b.len != n || obb.len != parent.len))) {
        PyErr_SetString(PyExc_ValueError, "propagate_pair: buffers of different lengths");
        goto done;
    }
    seen = calloc((size_t)(n ? n : 1), 1);
    if (seen == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int ok = pair_pass(ob.buf, wide, ob.len / width, parent.buf, a.buf, b.buf, outer, oa.buf, one ? NULL : obb.buf, n,
                       seen);
    result = PyBool_FromLong(ok);
done:
    free(seen);
    PyBuffer_Release(&ob);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&oa);
    PyBuffer_Release(&obb);
    return result;
}

/* ---- step_rows: each row's ProfilerStep by time ---- */

PyDoc_STRVAR(step_rows_doc,
             "step_rows(starts, last, numbers, ts, out)\n\n"
             "structure.step_numbers' search in one pass: out (int64, one per ts) gets, for the\n"
             "index i of numpy's searchsorted(starts, t, side='right') (NaN last), numbers[i - 1]\n"
             "where t <= last[i], else -1. starts (float64, sorted as numpy sorts, m), last\n"
             "(float64, m + 1; last[0] NaN), numbers (int64, m), ts (float64).");

/* numpy's searchsorted(starts, t, side='right') over m sorted starts, NaN last. */
static inline Py_ssize_t right_of(const double *starts, Py_ssize_t m, double t) {
    Py_ssize_t lo = 0, hi = m;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (less_nan_last(t, starts[mid])) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* Whether right_of(starts, m, t) can be at (given t sorts before starts[at] or at == m):
 * t sorts at or after starts[at - 1] (NaN last), or at == 0. */
static inline int fits_below(const double *starts, Py_ssize_t at, double t) {
    return at == 0 || !less_nan_last(t, starts[at - 1]);
}

static PyObject *step_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer sb, lb, nb, tb, ob;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &sb, &lb, &nb, &tb, &ob)) return NULL;
    Py_ssize_t m = sb.len / (Py_ssize_t)sizeof(double), n = tb.len / (Py_ssize_t)sizeof(double);
    PyObject *result = NULL;
    if (sb.len != m * (Py_ssize_t)sizeof(double) || lb.len != (m + 1) * (Py_ssize_t)sizeof(double) ||
        nb.len != sb.len || tb.len != n * (Py_ssize_t)sizeof(double) || ob.len != tb.len) {
        PyErr_SetString(PyExc_ValueError, "step_rows: buffers of different lengths");
        goto done;
    }
    const double *starts = sb.buf, *last = lb.buf, *ts = tb.buf;
    const int64_t *numbers = nb.buf;
    int64_t *out = ob.buf;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t at = 0; /* the last row's answer: a trace's rows are nearly in time order */
    for (Py_ssize_t i = 0; i < n; i++) {
        double t = ts[i];
        if (!(fits_below(starts, at, t) && (at == m || less_nan_last(t, starts[at])))) at = right_of(starts, m, t);
        out[i] = (at > 0 && t <= last[at]) ? numbers[at - 1] : -1;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&sb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&nb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ob);
    return result;
}

/* ---- take_rows, mark_codes, recode: per-row tables' columns taken at their rows ---- */

PyDoc_STRVAR(take_rows_doc,
             "take_rows(rows, wide, n, sources, outs)\n\n"
             "Each source (a column of n values of 1, 2, 4 or 8 bytes) taken at rows (int64\n"
             "where wide, else int32) into its out (one value per row): numpy's take of every\n"
             "column, the rows read once, a block at a time. ValueError where a row is outside\n"
             "0..n-1 or a buffer's length does not fit (outs then of no meaning).");

/* The rows of one block as indices; 0 where one is outside 0..n-1. */
static int block_rows(const void *rows, int wide, Py_ssize_t start, Py_ssize_t len, Py_ssize_t n, Py_ssize_t *idx) {
    for (Py_ssize_t i = 0; i < len; i++) {
        int64_t r = cand_row(rows, wide, start + i);
        if (r < 0 || r >= n) return 0;
        idx[i] = (Py_ssize_t)r;
    }
    return 1;
}

/* One column's values at a block of indices, by the width of its values. */
static void take_block(const char *src, char *dst, Py_ssize_t width, const Py_ssize_t *idx, Py_ssize_t len) {
    switch (width) {
    case 8:
        for (Py_ssize_t i = 0; i < len; i++) memcpy(dst + i * 8, src + idx[i] * 8, 8);
        break;
    case 4:
        for (Py_ssize_t i = 0; i < len; i++) memcpy(dst + i * 4, src + idx[i] * 4, 4);
        break;
    case 2:
        for (Py_ssize_t i = 0; i < len; i++) memcpy(dst + i * 2, src + idx[i] * 2, 2);
        break;
    default:
        for (Py_ssize_t i = 0; i < len; i++) dst[i] = src[idx[i]];
    }
}

#define TAKE_BLOCK 2048
#define TAKE_MAX 64

/* Whether a buffer's values are (or hold) Python objects, whose references a copy of their
 * bytes would not count: struct's 'O' in its format. */
static int holds_objects(const Py_buffer *buffer) {
    return buffer->format != NULL && strchr(buffer->format, 'O') != NULL;
}

/* take_rows' checks of the columns' buffers: their widths into width; 0 where one does not fit
 * (a column of Python objects included). */
static int take_widths(const Py_buffer *src, const Py_buffer *dst, Py_ssize_t k, Py_ssize_t n, Py_ssize_t m,
                       Py_ssize_t *width) {
    for (Py_ssize_t c = 0; c < k; c++) {
        if (holds_objects(&src[c]) || holds_objects(&dst[c])) return 0; /* copied as bytes: uncounted references */
        Py_ssize_t w = n ? src[c].len / n : (m ? dst[c].len / m : 1);
        if (!(w == 1 || w == 2 || w == 4 || w == 8) || src[c].len != n * w || dst[c].len != m * w) return 0;
        width[c] = w;
    }
    return 1;
}

/* take_rows' passes, the columns' buffers got: 0 where a row is outside the table. */
static int take_pass(const void *rows, int wide, Py_ssize_t m, Py_ssize_t n, const Py_buffer *src, Py_buffer *dst,
                     const Py_ssize_t *width, Py_ssize_t k) {
    Py_ssize_t idx[TAKE_BLOCK];
    for (Py_ssize_t start = 0; start < m; start += TAKE_BLOCK) {
        Py_ssize_t len = m - start < TAKE_BLOCK ? m - start : TAKE_BLOCK;
        if (!block_rows(rows, wide, start, len, n, idx)) return 0;
        for (Py_ssize_t c = 0; c < k; c++)
            take_block(src[c].buf, (char *)dst[c].buf + start * width[c], width[c], idx, len);
    }
    return 1;
}

static PyObject *take_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer rows, src[TAKE_MAX], dst[TAKE_MAX];
    Py_ssize_t n, width[TAKE_MAX], got = 0;
    int wide;
    PyObject *sources, *outs, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*pnO!O!", &rows, &wide, &n, &PyTuple_Type, &sources, &PyTuple_Type, &outs))
        return NULL;
    Py_ssize_t k = PyTuple_GET_SIZE(sources), m = rows.len / (wide ? 8 : 4);
    if (k > TAKE_MAX || PyTuple_GET_SIZE(outs) != k || rows.len % (wide ? 8 : 4) || n < 0) {
        PyErr_SetString(PyExc_ValueError, "take_rows: columns and outs do not fit");
        goto done;
    }
    for (; got < k; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(sources, got), &src[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(outs, got), &dst[got],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&src[got]);
            goto done;
        }
    }
    if (!take_widths(src, dst, k, n, m, width) || !take_pass(rows.buf, wide, m, n, src, dst, width, k)) {
        PyErr_SetString(PyExc_ValueError, "take_rows: a column or row that does not fit");
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t c = 0; c < got; c++) {
        PyBuffer_Release(&src[c]);
        PyBuffer_Release(&dst[c]);
    }
    PyBuffer_Release(&rows);
    return result;
}

/* A categorical's code i, of 1, 2, 4 or 8 bytes. */
static inline int64_t code_at(const void *codes, Py_ssize_t width, Py_ssize_t i) {
    switch (width) {
    case 1: return ((const int8_t *)codes)[i];
    case 2: return ((const int16_t *)codes)[i];
    case 4: return ((const int32_t *)codes)[i];
    default: return ((const int64_t *)codes)[i];
    }
}

static inline void put_code(void *codes, Py_ssize_t width, Py_ssize_t i, int64_t value) {
    switch (width) {
    case 1: ((int8_t *)codes)[i] = (int8_t)value; break;
    case 2: ((int16_t *)codes)[i] = (int16_t)value; break;
    case 4: ((int32_t *)codes)[i] = (int32_t)value; break;
    default: ((int64_t *)codes)[i] = value;
    }
}

PyDoc_STRVAR(recode_doc,
             "recode(codes, width, table, out, out_width) -> bool\n\n"
             "A categorical's codes (signed, width bytes each) through table (int64, one entry\n"
             "per category, then one for a missing code, -1): out (out_width bytes each) gets\n"
             "table[code], table[-1] where the code is -1. With an empty out, table (uint8)\n"
             "gets 1 at each code present instead (the codes used). False where a code is\n"
             "outside the table (out then of no meaning).");

/* recode's pass: marks (mark) or maps the codes; 0 where one is outside the table. */
static int recode_pass(const void *codes, Py_ssize_t width, Py_ssize_t n, void *table, Py_ssize_t entries, int mark,
                       void *out, Py_ssize_t out_width) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t c = code_at(codes, width, i);
        int64_t at = c < 0 ? entries - 1 : c;
        if (c < -1 || at >= entries) return 0;
        if (mark) ((uint8_t *)table)[at] = 1;
        else put_code(out, out_width, i, ((const int64_t *)table)[at]);
    }
    return 1;
}

static PyObject *recode(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer codes, table, out;
    Py_ssize_t width, out_width;
    if (!PyArg_ParseTuple(args, "y*nw*w*n", &codes, &width, &table, &out, &out_width)) return NULL;
    PyObject *result = NULL;
    int mark = out.len == 0;
    Py_ssize_t n = (width == 1 || width == 2 || width == 4 || width == 8) ? codes.len / width : -1;
    Py_ssize_t entries = mark ? table.len : table.len / 8;
    int fits = n >= 0 && codes.len == n * width && entries > 0 &&
               (mark || ((out_width == 1 || out_width == 2 || out_width == 4 || out_width == 8) &&
                         out.len == n * out_width && table.len == entries * 8));
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "recode: buffers that do not fit");
        goto done;
    }
    result = PyBool_FromLong(recode_pass(codes.buf, width, n, table.buf, entries, mark, out.buf, out_width));
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(rows_where_doc,
             "rows_where(rows, wide, mask, out) -> int\n\n"
             "The rows (int64 where wide, else int32) whose mask (uint8, one per table row) is\n"
             "set, in their order, into out (as wide as rows, room for all): rows[mask[rows]],\n"
             "without numpy's index array of intp; returns how many. ValueError where a row is\n"
             "outside the mask.");

static PyObject *rows_where(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer rows, mask, out;
    int wide;
    if (!PyArg_ParseTuple(args, "y*py*w*", &rows, &wide, &mask, &out)) return NULL;
    Py_ssize_t width = wide ? 8 : 4, m = rows.len / width, kept = 0;
    PyObject *result = NULL;
    const uint8_t *on = mask.buf;
    if (rows.len != m * width || out.len != rows.len) {
        PyErr_SetString(PyExc_ValueError, "rows_where: buffers of different lengths");
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = cand_row(rows.buf, wide, i);
        if (r < 0 || r >= mask.len) {
            PyErr_SetString(PyExc_ValueError, "rows_where: a row outside the mask");
            goto done;
        }
        if (!on[r]) continue;
        if (wide) ((int64_t *)out.buf)[kept++] = r;
        else ((int32_t *)out.buf)[kept++] = (int32_t)r;
    }
    result = PyLong_FromSsize_t(kept);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&mask);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(thread_key_rows_doc,
             "thread_key_rows(pid, pid_width, tid, tid_width, rank, out)\n\n"
             "structure.thread_keys in one pass: out (int64) gets ((pid + 1) << 21) | (tid + 1)\n"
             "| (rank << 42) per row, wrapped to 64 bits as numpy's int64 arithmetic wraps; pid\n"
             "and tid are categorical codes (signed, of their widths in bytes), rank int32, or\n"
             "empty for none.");

static PyObject *thread_key_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer pid, tid, rank, out;
    Py_ssize_t pw, tw;
    if (!PyArg_ParseTuple(args, "y*ny*ny*w*", &pid, &pw, &tid, &tw, &rank, &out)) return NULL;
    Py_ssize_t n = out.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    int widths = (pw == 1 || pw == 2 || pw == 4 || pw == 8) && (tw == 1 || tw == 2 || tw == 4 || tw == 8);
    if (!widths || out.len != n * (Py_ssize_t)sizeof(int64_t) || pid.len != n * pw || tid.len != n * tw ||
        (rank.len != 0 && rank.len != n * (Py_ssize_t)sizeof(int32_t))) {
        PyErr_SetString(PyExc_ValueError, "thread_key_rows: buffers of different lengths");
        goto done;
    }
    const int32_t *ranks = rank.len ? rank.buf : NULL;
    int64_t *keys = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* (+ 1 in unsigned arithmetic: it wraps as numpy's int64 does, with no signed overflow) */
        uint64_t key = (((uint64_t)code_at(pid.buf, pw, i) + 1u) << 21) | ((uint64_t)code_at(tid.buf, tw, i) + 1u);
        if (ranks) key |= (uint64_t)(int64_t)ranks[i] << 42;
        keys[i] = (int64_t)key;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&pid);
    PyBuffer_Release(&tid);
    PyBuffer_Release(&rank);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(take_codes_doc,
             "take_codes(codes, width, rows, wide, out)\n\n"
             "codes (signed integers of width bytes: a categorical's codes, row numbers) at rows\n"
             "(int64 where wide, else int32) into out (as wide as codes, one per row), -1 where\n"
             "a row is -1 (none): numpy's take, then out[rows < 0] = -1, in one pass and without\n"
             "an intp index. ValueError where a row is outside the table or below -1.");

static PyObject *take_codes(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer codes, rows, out;
    Py_ssize_t width;
    int wide;
    if (!PyArg_ParseTuple(args, "y*ny*pw*", &codes, &width, &rows, &wide, &out)) return NULL;
    Py_ssize_t rw = wide ? 8 : 4, m = rows.len / rw;
    Py_ssize_t n = (width == 1 || width == 2 || width == 4 || width == 8) ? codes.len / width : -1;
    PyObject *result = NULL;
    if (n < 0 || codes.len != n * width || rows.len != m * rw || out.len != m * width) {
        PyErr_SetString(PyExc_ValueError, "take_codes: buffers that do not fit");
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = cand_row(rows.buf, wide, i);
        if (r < -1 || r >= n) {
            PyErr_SetString(PyExc_ValueError, "take_codes: a row outside the table");
            goto done;
        }
        put_code(out.buf, width, i, r < 0 ? -1 : code_at(codes.buf, width, r));
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"propagate", propagate, METH_VARARGS, propagate_doc},
    {"nest_rows", nest_rows, METH_VARARGS, nest_rows_doc},
    {"order_rows", order_rows, METH_VARARGS, order_rows_doc},
    {"enclosing_at", enclosing_at, METH_VARARGS, enclosing_at_doc},
    {"chain_tops", chain_tops, METH_VARARGS, chain_tops_doc},
    {"outermost", outermost, METH_VARARGS, outermost_doc},
    {"union_rows", union_rows, METH_VARARGS, union_rows_doc},
    {"group_sums", group_sums, METH_VARARGS, group_sums_doc},
    {"window_parts", window_parts, METH_VARARGS, window_parts_doc},
    {"propagate_pair", propagate_pair, METH_VARARGS, propagate_pair_doc},
    {"step_rows", step_rows, METH_VARARGS, step_rows_doc},
    {"take_rows", take_rows, METH_VARARGS, take_rows_doc},
    {"recode", recode, METH_VARARGS, recode_doc},
    {"rows_where", rows_where, METH_VARARGS, rows_where_doc},
    {"take_codes", take_codes, METH_VARARGS, take_codes_doc},
    {"thread_key_rows", thread_key_rows, METH_VARARGS, thread_key_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_nesting", "Nesting of CPU events in one pass; see tracemagic/trace/_nesting.c.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nesting(void) { return PyModule_Create(&module); }
