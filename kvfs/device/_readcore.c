/* kvfs.device._readcore: the C read core (readcore.c) for Python callers.
 *
 * For the tests and for the bypass client: batched, verified block reads that
 * release the GIL for the reads, the hashing and the copies out, so several
 * threads really read and hash at once. read_into lands blocks straight in the
 * caller's buffers and keeps several runs in flight on threads of its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "readcore.h"

/* Below this many bytes, hashing costs less than letting go of the GIL and taking it back. */
#define MATCHES_NOGIL_BYTES (64 * 1024)

/* An int in [0, max] into *out; TypeError if not an int, ValueError if out of range. */
static int as_u64(PyObject *o, const char *what, uint64_t max, uint64_t *out)
{
    int overflow;
    long long v;

    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow < 0 || (!overflow && v < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative, got %R", what, o);
        return -1;
    }
    if (overflow) {                     /* above LLONG_MAX: a seed may be up to 2**64 - 1 */
        unsigned long long u = PyLong_AsUnsignedLongLong(o);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s is too large: %R", what, o);
            return -1;
        }
        *out = u;
    } else {
        *out = (uint64_t)v;
    }
    if (*out > max) {
        PyErr_Format(PyExc_ValueError, "%s is too large: %R (at most %llu)", what, o, (unsigned long long)max);
        return -1;
    }
    return 0;
}

/* Copy a bytes-like `o` of one of the allowed sizes (a or b) into dst; its size into *len. */
static int copy_bytes(PyObject *o, const char *what, size_t a, size_t b, uint8_t *dst, size_t *len)
{
    Py_buffer view;

    if (PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    if ((size_t)view.len != a && (size_t)view.len != b) {
        if (a == b)
            PyErr_Format(PyExc_ValueError, "%s must be %zu bytes, got %zd", what, a, view.len);
        else
            PyErr_Format(PyExc_ValueError, "%s must be %zu or %zu bytes, got %zd", what, a, b, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(dst, view.buf, (size_t)view.len);
    if (len)
        *len = (size_t)view.len;
    PyBuffer_Release(&view);
    return 0;
}

/* The store's key base from a seed and an optional secret (b"" or 32 bytes). */
static int key_base(PyObject *seed, PyObject *secret, struct kvfs_key_base *kb)
{
    uint64_t s;
    size_t len = 0;

    memset(kb, 0, sizeof *kb);
    if (as_u64(seed, "seed", UINT64_MAX, &s) < 0)
        return -1;
    kb->seed = s;
    if (secret && copy_bytes(secret, "secret", 0, KVFS_SECRET_MAX, kb->secret, &len) < 0)
        return -1;
    kb->secret_len = (uint32_t)len;
    return 0;
}

/* One (dev_off, length, key, salt) tuple into *c. */
static int parse_block(PyObject *item, Py_ssize_t i, struct kvfs_block_check *c)
{
    char what[48];
    uint64_t v;
    size_t salt_len;

    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 4) {
        PyErr_Format(PyExc_TypeError, "blocks[%zd] must be a (dev_off, length, key, salt) tuple, not %.100s",
                     i, Py_TYPE(item)->tp_name);
        return -1;
    }
    memset(c, 0, sizeof *c);
    snprintf(what, sizeof what, "blocks[%zd] dev_off", i);
    if (as_u64(PyTuple_GET_ITEM(item, 0), what, INT64_MAX, &v) < 0)
        return -1;
    if (v % KVFS_SECTOR) {
        PyErr_Format(PyExc_ValueError, "%s must be a multiple of %d, got %llu", what, KVFS_SECTOR,
                     (unsigned long long)v);
        return -1;
    }
    c->dev_off = v;
    snprintf(what, sizeof what, "blocks[%zd] length", i);
    if (as_u64(PyTuple_GET_ITEM(item, 1), what, UINT32_MAX, &v) < 0)
        return -1;
    c->length = (uint32_t)v;
    if (c->dev_off > (uint64_t)INT64_MAX - kvfs_span(c->length)) {
        PyErr_Format(PyExc_ValueError, "blocks[%zd] ends beyond the largest device offset", i);
        return -1;
    }
    snprintf(what, sizeof what, "blocks[%zd] key", i);
    if (copy_bytes(PyTuple_GET_ITEM(item, 2), what, KVFS_KEY_BYTES, KVFS_KEY_BYTES, c->key, NULL) < 0)
        return -1;
    snprintf(what, sizeof what, "blocks[%zd] salt", i);
    if (copy_bytes(PyTuple_GET_ITEM(item, 3), what, 0, KVFS_SALT_BYTES, c->salt, &salt_len) < 0)
        return -1;
    c->salted = salt_len != 0;
    return 0;
}

PyDoc_STRVAR(read_verified_doc,
"read_verified(fd, seed, blocks, secret=b'') -> list[bytes | None]\n\n"
"Read each (dev_off, length, key, salt) block from fd (adjacent blocks with one\n"
"preadv) and check it hashes to key: xxh3-128(secret + salt + data, seed).\n"
"Per block: its `length` bytes, or None if it failed its check.\n"
"OSError on a read error (EIO for a block cut short by the end of the device).");

static PyObject *read_verified(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "seed", "blocks", "secret", NULL};
    PyObject *fd_obj, *seed, *blocks_obj, *secret = NULL, *seq = NULL, *result = NULL;
    struct kvfs_key_base kb;
    struct kvfs_block_check *checks = NULL;
    uint8_t **bufs = NULL, *ok = NULL, *mem = NULL;
    PyObject **out = NULL;
    Py_ssize_t n = 0, i;
    size_t total = 0, pos = 0;
    uint64_t fd;
    int rc;

    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O:read_verified", kwlist,
                                     &fd_obj, &seed, &blocks_obj, &secret))
        return NULL;
    if (as_u64(fd_obj, "fd", INT_MAX, &fd) < 0 || key_base(seed, secret, &kb) < 0)
        return NULL;
    seq = PySequence_Fast(blocks_obj, "blocks must be a list of (dev_off, length, key, salt) tuples");
    if (!seq)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    checks = PyMem_Calloc((size_t)n + 1, sizeof *checks);
    bufs = PyMem_Calloc((size_t)n + 1, sizeof *bufs);
    ok = PyMem_Calloc((size_t)n + 1, 1);
    out = PyMem_Calloc((size_t)n + 1, sizeof *out);
    if (!checks || !bufs || !ok || !out) {
        PyErr_NoMemory();
        goto done;
    }
    for (i = 0; i < n; i++) {
        if (parse_block(PySequence_Fast_GET_ITEM(seq, i), i, &checks[i]) < 0)
            goto done;
        if (kvfs_span(checks[i].length) > SIZE_MAX - total) {
            PyErr_NoMemory();
            goto done;
        }
        total += kvfs_span(checks[i].length);
    }
    /* One aligned region for the whole batch, sliced per block: O_DIRECT needs
       sector-aligned buffers, and bytes objects are not. */
    if (total && posix_memalign((void **)&mem, KVFS_SECTOR, total)) {
        mem = NULL;
        PyErr_NoMemory();
        goto done;
    }
    /* The results are made here, with the GIL, and filled without it below. */
    for (i = 0; i < n; pos += kvfs_span(checks[i].length), i++) {
        bufs[i] = mem + pos;
        if (!(out[i] = PyBytes_FromStringAndSize(NULL, checks[i].length)))
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = kvfs_read_verified_keyed((int)fd, &kb, checks, (size_t)n, bufs, ok);
    if (rc >= 0)
        for (i = 0; i < n; i++)
            if (ok[i])
                memcpy(PyBytes_AS_STRING(out[i]), bufs[i], checks[i].length);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (!(result = PyList_New(n)))
        goto done;
    for (i = 0; i < n; i++) {
        if (ok[i]) {
            PyList_SET_ITEM(result, i, out[i]);
            out[i] = NULL;
        } else {
            PyList_SET_ITEM(result, i, Py_NewRef(Py_None));
        }
    }
done:
    if (out)
        for (i = 0; i < n; i++)
            Py_XDECREF(out[i]);
    free(mem);
    PyMem_Free(out);
    PyMem_Free(ok);
    PyMem_Free(bufs);
    PyMem_Free(checks);
    Py_XDECREF(seq);
    return result;
}

PyDoc_STRVAR(matches_doc,
"matches(seed, data, key, salt=b'', secret=b'') -> bool\n\n"
"Does data hash to key: xxh3-128(secret + salt + data, seed) == key?");

static PyObject *matches(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"seed", "data", "key", "salt", "secret", NULL};
    PyObject *seed, *data, *key, *salt = NULL, *secret = NULL;
    struct kvfs_key_base kb;
    struct kvfs_block_check c;
    Py_buffer view;
    size_t salt_len = 0;
    int hit;

    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OO:matches", kwlist, &seed, &data, &key, &salt, &secret))
        return NULL;
    memset(&c, 0, sizeof c);
    if (key_base(seed, secret, &kb) < 0
        || copy_bytes(key, "key", KVFS_KEY_BYTES, KVFS_KEY_BYTES, c.key, NULL) < 0
        || (salt && copy_bytes(salt, "salt", 0, KVFS_SALT_BYTES, c.salt, &salt_len) < 0))
        return NULL;
    c.salted = salt_len != 0;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "data must be bytes-like, not %.100s", Py_TYPE(data)->tp_name);
        return NULL;
    }
    if ((uint64_t)view.len > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "data is too long for a block: %zd bytes", view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    c.length = (uint32_t)view.len;
    if (view.len >= MATCHES_NOGIL_BYTES) {
        /* The exported buffer cannot be resized or freed while we hold the view. */
        Py_BEGIN_ALLOW_THREADS
        hit = kvfs_block_matches_keyed(&kb, &c, view.buf);
        Py_END_ALLOW_THREADS
    } else {
        hit = kvfs_block_matches_keyed(&kb, &c, view.buf);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(hit);
}

/* -- read_into: many blocks straight into caller buffers, several threads at once ---------- */

#define INTO_TASK_BYTES (4u << 20)      /* one worker's run at a time: a few MiB keeps every thread busy */
#define INTO_TASK_BLOCKS 256
#define INTO_THREADS_MAX 64

struct into_job {
    int fd;
    const struct kvfs_key_base *kb;
    const struct kvfs_block_check *checks;
    uint8_t *const *dests;              /* where block i lands: its first file byte in the caller's buffer */
    const size_t *copies;               /* bytes of the file block i covers there (<= length: copied;
                                           beyond length: zeros) */
    const size_t *task_first;           /* task t is blocks [task_first[t], task_first[t + 1]) */
    size_t ntasks;
    size_t bounce_bytes;                /* the largest task's span: each worker's aligned bounce buffer */
    size_t next;                        /* the next task to take (atomic) */
    int err;                            /* the first -errno (atomic); workers stop taking tasks */
    uint8_t *ok;
};

/* A block lands in place when O_DIRECT can write it there: an aligned start, whole sectors, all of it wanted. */
static int into_direct(const struct into_job *job, size_t b)
{
    const struct kvfs_block_check *c = &job->checks[b];
    return c->length && c->length % KVFS_SECTOR == 0 && job->copies[b] == c->length
        && (uintptr_t)job->dests[b] % KVFS_SECTOR == 0;
}

static void *into_worker(void *arg)
{
    struct into_job *job = arg;
    uint8_t *bounce = NULL, *bufs[INTO_TASK_BLOCKS];

    for (;;) {
        size_t t = __atomic_fetch_add(&job->next, 1, __ATOMIC_SEQ_CST), first, count, i, pos = 0;
        int rc;

        if (t >= job->ntasks || __atomic_load_n(&job->err, __ATOMIC_SEQ_CST))
            break;
        first = job->task_first[t];
        count = job->task_first[t + 1] - first;
        for (i = 0; i < count; i++) {
            if (into_direct(job, first + i)) {
                bufs[i] = job->dests[first + i];
            } else {
                /* Taken at the first block that needs it: buffers that are aligned need none. */
                if (!bounce && posix_memalign((void **)&bounce, KVFS_SECTOR, job->bounce_bytes)) {
                    int expected = 0;
                    bounce = NULL;
                    __atomic_compare_exchange_n(&job->err, &expected, -ENOMEM, 0, __ATOMIC_SEQ_CST,
                                                __ATOMIC_SEQ_CST);
                    return NULL;
                }
                bufs[i] = bounce + pos;
                pos += kvfs_span(job->checks[first + i].length);
            }
        }
        rc = kvfs_read_verified_keyed(job->fd, job->kb, job->checks + first, count, bufs, job->ok + first);
        if (rc < 0) {
            int expected = 0;
            __atomic_compare_exchange_n(&job->err, &expected, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            break;
        }
        for (i = 0; i < count; i++) {
            size_t b = first + i, len = job->checks[b].length, copy = job->copies[b];
            if (!job->ok[b] || bufs[i] == job->dests[b])
                continue;
            memcpy(job->dests[b], bufs[i], copy < len ? copy : len);
            if (copy > len)
                memset(job->dests[b] + len, 0, copy - len);
        }
    }
    free(bounce);
    return NULL;
}

/* Run the job on `threads` threads, this one among them. 0, or -errno. */
static int into_run(struct into_job *job, size_t threads)
{
    pthread_t tids[INTO_THREADS_MAX];
    size_t started = 0, i;

    if (threads > job->ntasks)
        threads = job->ntasks;
    for (i = 1; i < threads; i++) {
        if (pthread_create(&tids[started], NULL, into_worker, job))
            break;                      /* fewer threads: the ones running take every task anyway */
        started++;
    }
    into_worker(job);
    for (i = 0; i < started; i++)
        pthread_join(tids[i], NULL);
    return job->err;
}

PyDoc_STRVAR(read_into_doc,
"read_into(fd, seed, blocks, dests, secret=b'', threads=8) -> list[int]\n\n"
"Read each (dev_off, length, key, salt, dest, dest_off, copy) block from fd and\n"
"check it hashes to key: xxh3-128(secret + salt + data, seed). A block that\n"
"passes lands in the writable buffer dests[dest] at dest_off: its first `copy`\n"
"bytes (zeros past `length`). Adjacent blocks are read with one preadv, runs of a\n"
"few MiB on up to `threads` threads at once, without the GIL; a block whose\n"
"span is whole sectors at a sector-aligned place lands there with no copy.\n"
"Returns the indices of the blocks that failed their check (their bytes in the\n"
"buffer are then unspecified). OSError on a read error.");

static PyObject *read_into(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"fd", "seed", "blocks", "dests", "secret", "threads", NULL};
    PyObject *fd_obj, *seed, *blocks_obj, *dests_obj, *secret = NULL, *threads_obj = NULL;
    PyObject *seq = NULL, *dseq = NULL, *result = NULL;
    struct kvfs_key_base kb;
    struct kvfs_block_check *checks = NULL;
    uint8_t **dests = NULL, *ok = NULL;
    size_t *copies = NULL, *task_first = NULL, ntasks = 0, bounce = 0, run_bytes = 0;
    Py_buffer *views = NULL;
    Py_ssize_t n = 0, nd = 0, got = 0, i;
    uint64_t fd, threads = 8, v;
    struct into_job job;
    int rc;

    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|OO:read_into", kwlist,
                                     &fd_obj, &seed, &blocks_obj, &dests_obj, &secret, &threads_obj))
        return NULL;
    if (as_u64(fd_obj, "fd", INT_MAX, &fd) < 0 || key_base(seed, secret, &kb) < 0
        || (threads_obj && as_u64(threads_obj, "threads", INTO_THREADS_MAX, &threads) < 0))
        return NULL;
    if (!threads)
        threads = 1;
    seq = PySequence_Fast(blocks_obj, "blocks must be a list of (dev_off, length, key, salt, dest, dest_off, copy)");
    dseq = seq ? PySequence_Fast(dests_obj, "dests must be a list of writable buffers") : NULL;
    if (!dseq)
        goto done;
    n = PySequence_Fast_GET_SIZE(seq);
    nd = PySequence_Fast_GET_SIZE(dseq);
    views = PyMem_Calloc((size_t)nd + 1, sizeof *views);
    checks = PyMem_Calloc((size_t)n + 1, sizeof *checks);
    dests = PyMem_Calloc((size_t)n + 1, sizeof *dests);
    copies = PyMem_Calloc((size_t)n + 1, sizeof *copies);
    task_first = PyMem_Calloc((size_t)n + 2, sizeof *task_first);
    ok = PyMem_Calloc((size_t)n + 1, 1);
    if (!views || !checks || !dests || !copies || !task_first || !ok) {
        PyErr_NoMemory();
        goto done;
    }
    for (got = 0; got < nd; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(dseq, got), &views[got], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *head;
        uint64_t dest, dest_off, copy;
        char what[48];

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 7) {
            PyErr_Format(PyExc_TypeError, "blocks[%zd] must be a (dev_off, length, key, salt, dest, dest_off, copy) "
                         "tuple", i);
            goto done;
        }
        head = PyTuple_GetSlice(item, 0, 4);
        rc = head ? parse_block(head, i, &checks[i]) : -1;
        Py_XDECREF(head);
        if (rc < 0)
            goto done;
        snprintf(what, sizeof what, "blocks[%zd] dest", i);
        if (as_u64(PyTuple_GET_ITEM(item, 4), what, nd ? (uint64_t)nd - 1 : 0, &dest) < 0)
            goto done;
        if (!nd) {
            PyErr_SetString(PyExc_ValueError, "no dests for the blocks");
            goto done;
        }
        snprintf(what, sizeof what, "blocks[%zd] dest_off", i);
        if (as_u64(PyTuple_GET_ITEM(item, 5), what, (uint64_t)views[dest].len, &dest_off) < 0)
            goto done;
        snprintf(what, sizeof what, "blocks[%zd] copy", i);
        if (as_u64(PyTuple_GET_ITEM(item, 6), what, (uint64_t)views[dest].len - dest_off, &copy) < 0)
            goto done;
        dests[i] = (uint8_t *)views[dest].buf + dest_off;
        copies[i] = (size_t)copy;
        /* A new task where the run breaks, or grows too long. */
        v = kvfs_span(checks[i].length);
        if (!i || checks[i].dev_off != checks[i - 1].dev_off + kvfs_span(checks[i - 1].length)
            || run_bytes + v > INTO_TASK_BYTES || i - task_first[ntasks - 1] >= INTO_TASK_BLOCKS) {
            task_first[ntasks++] = (size_t)i;
            run_bytes = 0;
        }
        run_bytes += v;
        if (run_bytes > bounce)
            bounce = run_bytes;
    }
    task_first[ntasks] = (size_t)n;
    memset(&job, 0, sizeof job);
    job.fd = (int)fd;
    job.kb = &kb;
    job.checks = checks;
    job.dests = dests;
    job.copies = copies;
    job.task_first = task_first;
    job.ntasks = ntasks;
    job.bounce_bytes = bounce;
    job.ok = ok;
    Py_BEGIN_ALLOW_THREADS
    rc = ntasks ? into_run(&job, (size_t)threads) : 0;
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        errno = -rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (!(result = PyList_New(0)))
        goto done;
    for (i = 0; i < n; i++) {
        if (!ok[i]) {
            PyObject *idx = PyLong_FromSsize_t(i);
            if (!idx || PyList_Append(result, idx) < 0) {
                Py_XDECREF(idx);
                Py_CLEAR(result);
                goto done;
            }
            Py_DECREF(idx);
        }
    }
done:
    for (i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(ok);
    PyMem_Free(task_first);
    PyMem_Free(copies);
    PyMem_Free(dests);
    PyMem_Free(checks);
    Py_XDECREF(dseq);
    Py_XDECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"read_verified", (PyCFunction)(void (*)(void))read_verified, METH_VARARGS | METH_KEYWORDS, read_verified_doc},
    {"read_into", (PyCFunction)(void (*)(void))read_into, METH_VARARGS | METH_KEYWORDS, read_into_doc},
    {"matches", (PyCFunction)(void (*)(void))matches, METH_VARARGS | METH_KEYWORDS, matches_doc},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *m)
{
    return PyModule_AddIntConstant(m, "SECTOR", KVFS_SECTOR) < 0
        || PyModule_AddIntConstant(m, "SECRET_MAX", KVFS_SECRET_MAX) < 0 ? -1 : 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvfs.device._readcore",
    .m_doc = "The C read core (kvfs/device/readcore.c): batched device reads of kvfs blocks, verified.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__readcore(void)
{
    return PyModuleDef_Init(&module);
}
