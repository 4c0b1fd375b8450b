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

static PyMethodDef methods[] = {
    {"nest_sorted", nest_sorted, METH_VARARGS, nest_sorted_doc},
    {"propagate", propagate, METH_VARARGS, propagate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_nesting", "Nesting of CPU events in one pass; see tracemagic/trace/_nesting.c.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__nesting(void) { return PyModule_Create(&module); }
