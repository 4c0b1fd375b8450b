/* Nesting of CPU events in one pass: each event's parent and depth (a stack per thread),
 * and each event's innermost enclosing event of a kind (memoized climbs up the parents).
 *
 * Why: structure.previous_enclosing and structure.propagate answer the same questions
 * with numpy (binary lifting over ~18 full passes; one pass per nesting level), which was
 * the largest part of preparing a large trace and of attributing it to layers; these are
 * O(n). structure uses them where built and its numpy code otherwise (tests/test_scan.py
 * compares the two on every shared trace).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

PyDoc_STRVAR(nest_sorted_doc,
             "nest_sorted(group, start, end, tolerance, margin, parent, depth)\n\n"
             "For rows sorted by (group, start, -end) (int64, float64 and float64 buffers), fill\n"
             "parent (int64: the nearest earlier row of the same group that encloses this one, else\n"
             "-1) and depth (int32: its parent's + 1). A row encloses a later one that starts with it,\n"
             "or that ends at most tolerance after it ends and starts at least margin before it ends.");

static PyObject *nest_sorted(PyObject *Py_UNUSED(self), PyObject *args) {
    Py_buffer group, start, end, parent, depth;
    double tolerance, margin;
    if (!PyArg_ParseTuple(args, "y*y*y*ddw*w*", &group, &start, &end, &tolerance, &margin, &parent, &depth)) return NULL;
    Py_ssize_t n = group.len / (Py_ssize_t)sizeof(int64_t);
    PyObject *result = NULL;
    int64_t *stack = NULL;
    if (start.len != n * (Py_ssize_t)sizeof(double) || end.len != n * (Py_ssize_t)sizeof(double) ||
        parent.len != n * (Py_ssize_t)sizeof(int64_t) || depth.len != n * (Py_ssize_t)sizeof(int32_t)) {
        PyErr_SetString(PyExc_ValueError, "nest_sorted: buffers of different lengths");
        goto done;
    }
    stack = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (stack == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *g = group.buf;
    const double *s = start.buf;
    const double *e = end.buf;
    int64_t *up = parent.buf;
    int32_t *level = depth.buf;
    Py_ssize_t top = 0; /* stack size */
    for (Py_ssize_t i = 0; i < n; i++) {
        int same_thread = i > 0 && g[i] == g[i - 1];
        if (!same_thread) top = 0; /* a new thread */
        /* a row starting with the one before it nests in it (on top of the stack); else a
         * row that ends too early, or before this one starts, cannot enclose it nor
         * anything after it */
        if (!(same_thread && s[i] == s[i - 1])) {
            double target = e[i] - tolerance;
            if (s[i] + margin > target) target = s[i] + margin;
            while (top > 0 && !(e[stack[top - 1]] >= target)) top--;
        }
        up[i] = top > 0 ? stack[top - 1] : -1;
        level[i] = top > 0 ? level[stack[top - 1]] + 1 : 0;
        stack[top++] = i;
    }
    result = Py_NewRef(Py_None);
done:
    free(stack);
    PyBuffer_Release(&group);
    PyBuffer_Release(&start);
    PyBuffer_Release(&end);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&depth);
    return result;
}

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

#define NEST_MAX_THREADS 256

/* The set rows (on, n) by key, ascending, each key's in table order, into ordered; per: the
 * first position of each key's rows (distinct + 1 entries); bucket: n scratch. Returns the
 * number of distinct keys, or -1 where there are more than NEST_MAX_THREADS. */
static int bucket_rows(const uint8_t *on, const int64_t *key, Py_ssize_t n, int64_t *ordered, Py_ssize_t *per,
                       uint8_t *bucket) {
    int64_t seen[NEST_MAX_THREADS]; /* the distinct keys, in order of discovery */
    int distinct = 0, last = -1;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (!on[r]) continue;
        if (last < 0 || seen[last] != key[r]) {
            last = -1;
            for (int k = 0; k < distinct && last < 0; k++)
                if (seen[k] == key[r]) last = k;
            if (last < 0) {
                if (distinct == NEST_MAX_THREADS) return -1;
                seen[distinct] = key[r];
                last = distinct++;
            }
        }
        bucket[r] = (uint8_t)last;
    }
    int rank[NEST_MAX_THREADS]; /* of each discovered key among the sorted keys */
    Py_ssize_t fill[NEST_MAX_THREADS];
    for (int k = 0; k < distinct; k++) {
        rank[k] = 0;
        for (int j = 0; j < distinct; j++) rank[k] += seen[j] < seen[k];
    }
    for (int k = 0; k <= distinct; k++) per[k] = 0;
    for (Py_ssize_t r = 0; r < n; r++)
        if (on[r]) per[rank[bucket[r]] + 1]++;
    for (int k = 0; k < distinct; k++) per[k + 1] += per[k];
    for (int k = 0; k < distinct; k++) fill[k] = per[k];
    for (Py_ssize_t r = 0; r < n; r++)
        if (on[r]) ordered[fill[rank[bucket[r]]]++] = r;
    return distinct;
}

/* nest_sorted's walk over the m rows of ordered (sorted by key, start, longest first):
 * parent and depth by row, and each position's children's durations summed in child (m,
 * zeroed) in that order; start and stack: m and m scratch. */
static void walk_rows(const int64_t *ordered, Py_ssize_t m, const int64_t *key, const double *ts, const double *dur,
                      double t0, double tolerance, double margin, int64_t *up, int32_t *level, double *child,
                      double *start, int64_t *stack) {
    Py_ssize_t top = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = ordered[i];
        double s = ts[r] - t0;
        double e = s + dur[r];
        start[i] = s;
        int same_thread = i > 0 && key[r] == key[ordered[i - 1]];
        if (!same_thread) top = 0;
        if (!(same_thread && s == start[i - 1])) {
            double target = e - tolerance;
            if (s + margin > target) target = s + margin;
            while (top > 0 && !(ts[ordered[stack[top - 1]]] - t0 + dur[ordered[stack[top - 1]]] >= target)) top--;
        }
        if (top > 0) {
            int64_t p = stack[top - 1];
            up[r] = ordered[p];
            level[r] = level[ordered[p]] + 1;
            child[p] += dur[r];
        } else {
            level[r] = 0;
        }
        stack[top++] = i;
    }
}

PyDoc_STRVAR(nest_rows_doc,
             "nest_rows(mask, keys, ts, dur, t0, tolerance, margin, ordered, parent, depth, self_dur) -> bool\n\n"
             "structure.nest in one call: the rows where mask (uint8, n) is set, sorted by (keys,\n"
             "ts, -dur) as numpy's stable lexsort does (NaN last), into ordered (int64, one per set\n"
             "row); for those rows parent (int64, a row number), depth (int32) and self_dur (float64:\n"
             "dur less the children's durations summed in that order, at least 0) as nest_sorted\n"
             "and numpy give them, from starts ts - t0; -1, -1 and dur elsewhere. False (nothing\n"
             "written) where the rows have more than 256 distinct keys: the caller sorts with numpy.");

/* nest_rows on checked buffers: 1 done, 0 too many keys, -1 out of memory. */
static int nest_rows_checked(const uint8_t *on, const int64_t *key, const double *ts, const double *dur, double t0,
                             double tolerance, double margin, Py_ssize_t n, int64_t *ordered, Py_ssize_t m,
                             int64_t *up, int32_t *level, double *self_dur) {
    Py_ssize_t per[NEST_MAX_THREADS + 1];
    int status = -1;
    uint8_t *bucket = malloc(n > 0 ? (size_t)n : 1);
    int64_t *tmp = malloc(sizeof(int64_t) * (size_t)(m ? m : 1));
    int64_t *stack = malloc(sizeof(int64_t) * (size_t)(m + 1)); /* also the sort's run bounds */
    double *child = calloc((size_t)(m ? m : 1), sizeof(double));
    if (bucket == NULL || tmp == NULL || stack == NULL || child == NULL) goto done;
    int distinct = bucket_rows(on, key, n, ordered, per, bucket);
    status = 0;
    if (distinct < 0) goto done;
    for (int k = 0; k < distinct; k++) /* each thread's rows by (start, longest first) */
        sort_rows(ordered + per[k], tmp, (Py_ssize_t *)stack, per[k + 1] - per[k], ts, dur);
    for (Py_ssize_t r = 0; r < n; r++) {
        up[r] = -1;
        level[r] = -1;
        self_dur[r] = dur[r];
    }
    walk_rows(ordered, m, key, ts, dur, t0, tolerance, margin, up, level, child, (double *)tmp, stack);
    for (Py_ssize_t i = 0; i < m; i++) {
        double own = dur[ordered[i]] - child[i];
        self_dur[ordered[i]] = own < 0.0 ? 0.0 : own;
    }
    status = 1;
done:
    free(bucket);
    free(tmp);
    free(stack);
    free(child);
    return status;
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
    Py_ssize_t count = 0;
    for (Py_ssize_t r = 0; r < n; r++) count += ((const uint8_t *)mask.buf)[r] != 0;
    if (keys.len != n * (Py_ssize_t)sizeof(int64_t) || tsb.len != n * (Py_ssize_t)sizeof(double) ||
        durb.len != n * (Py_ssize_t)sizeof(double) || parb.len != n * (Py_ssize_t)sizeof(int64_t) ||
        depb.len != n * (Py_ssize_t)sizeof(int32_t) || selfb.len != n * (Py_ssize_t)sizeof(double) ||
        ordb.len != m * (Py_ssize_t)sizeof(int64_t) || count != m) {
        PyErr_SetString(PyExc_ValueError, "nest_rows: buffers of different lengths");
    } else {
        int status = nest_rows_checked(mask.buf, keys.buf, tsb.buf, durb.buf, t0, tolerance, margin, n, ordb.buf, m,
                                       parb.buf, depb.buf, selfb.buf);
        if (status < 0)
            PyErr_NoMemory();
        else
            result = Py_NewRef(status ? Py_True : Py_False);
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

static PyMethodDef methods[] = {
    {"nest_sorted", nest_sorted, METH_VARARGS, nest_sorted_doc},
    {"propagate", propagate, METH_VARARGS, propagate_doc},
    {"nest_rows", nest_rows, METH_VARARGS, nest_rows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_nesting", "Nesting of CPU events in one pass; see tracemagic/trace/_nesting.c.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nesting(void) { return PyModule_Create(&module); }
