/* The native read plane: a front end on /dev/fuse that serves READs of sealed
 * files without Python, beside pyfuse3, which still serves everything else.
 *
 * Why. pyfuse3 answers every request from one thread that holds the GIL, so a
 * cold 1 MiB READ costs a trip through trio, the block cache and a reply
 * written under the GIL; with an engine reading at several GB/s that thread
 * is the limit (issue 34). The kernel lets one connection be served from many
 * threads (cloned /dev/fuse descriptors, FUSE_DEV_IOC_CLONE), and libfuse,
 * given "/dev/fd/N" as its mount point, uses descriptor N as its device
 * without mounting anything. So kvfs mounts the filesystem itself
 * (kvfs/fuse/frontend.py), gives pyfuse3 one end of a SOCK_SEQPACKET
 * socketpair as its "device", and this module sits between the two:
 *
 *   kernel --/dev/fuse (one descriptor per reader thread)--> reader threads
 *      READ of a published file: read the blocks, verify each against its
 *        key (kvfs/device/readcore.c), reply on the descriptor it came from;
 *      anything else, or any doubt: forward the request bytes, unchanged,
 *        as one message to pyfuse3.
 *   pyfuse3 --socket--> relay thread: each reply goes back on the descriptor
 *      that read its request (the kernel looks a reply up in that
 *      descriptor's processing list); notifications (unique 0) go on any.
 *
 * Publication. Python publishes a file's extents (block size, size, per block
 * the device offset, length, key and salt) under its inode number, and
 * withdraws them on any change before that change is answered
 * (kvfs/fuse/frontend.py, kvfs/namespace). A READ that finds nothing, a
 * device error or a block that fails its key goes to pyfuse3, which reads
 * and verifies on its own and answers EIO if the block really is bad: the
 * native path never answers an error and never wrong bytes.
 *
 * Never stalled by Python. Forwarding never blocks a reader thread: when the
 * socket is full (pyfuse3 busy with a checkpoint), requests queue in memory
 * for a sender thread, in order, and the readers go on serving READs.
 *
 * Shutdown. A reader that gets ENODEV (unmounted, aborted) writes the
 * "ended" eventfd, which Python waits on to end pyfuse3's loop. stop() wakes
 * blocked readers with a signal (a read of /dev/fuse is interruptible) and
 * shuts the socket's read side down for the relay. If the process dies the
 * descriptors close and the kernel aborts the connection (ENOTCONN), as with
 * plain pyfuse3.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../device/readcore.h"

/* A request is at most max_write (1 MiB with libfuse's defaults) plus its
 * headers; the kernel refuses reads into smaller buffers. */
#define REQUEST_BUFFER ((2u << 20) + 8192u)
/* A reply from pyfuse3: a READ of up to max_read bytes, or a notification. */
#define REPLY_BUFFER ((4u << 20) + 8192u)
#define TABLE_BUCKETS 4096u
#define HOLE UINT64_MAX                 /* dev_off of a block that is all zeros */
#define ZERO_CHUNK 65536u
#define MAX_IOV 1024
#define WAKE_SIGNAL (SIGRTMIN + 7)
/* The kernel's unique of an INTERRUPT is the interrupted request's with bit 0
 * set (FUSE_INT_REQ_BIT in fs/fuse/fuse_i.h, not in the uapi header). */
#define FUSE_INT_REQ_BIT 1ull
/* Protocol 7.39: MAP_SHARED mmap of a file opened with FOPEN_DIRECT_IO (older uapi
 * headers lack it). kvfs answers read-only opens of published files that way with
 * native_direct_io=on, and engines mmap chunk files (numpy.memmap, safetensors). */
#ifndef FUSE_DIRECT_IO_ALLOW_MMAP
#define FUSE_DIRECT_IO_ALLOW_MMAP (1ull << 36)
#endif      /* interrupts a reader blocked in read() at stop */

static const uint8_t zeros[ZERO_CHUNK];

/* A file's content as published. READs are ordered by the kernel's unique
 * (assigned in queue order, handed out in that order): this version answers a
 * READ whose unique u has from < u <= until, i.e. one handed out while it was
 * the file's content. A withdrawn version (until set) stays a while for READs
 * that were handed out before the change but looked up after it: answered
 * with the content they would have got from pyfuse3, which reads requests in
 * order (kvfs/namespace/truncation.py has the race this keeps closed).
 * Python pins a version's blocks under its `token` while the version may be
 * read (kvfs/fuse/frontend.py): a withdrawn version's extents are not reused
 * until collect_versions() has freed it and handed its token back. */
struct published {
    struct published *next;
    struct published *next_withdrawn;  /* the FIFO of withdrawn versions, oldest first */
    uint64_t from, until;               /* uniques: handed out when published / withdrawn */
    uint64_t nodeid, generation, size, token;
    uint32_t block_size, nblocks;
    struct kvfs_block_check blocks[];   /* in file order; dev_off == HOLE: zeros */
};

struct pending {                        /* a forwarded request that awaits pyfuse3's reply */
    struct pending *next;
    uint64_t unique;
    int fd;
};

struct queued {                         /* a message waiting for its thread to deliver it */
    struct queued *next;
    size_t len;
    char data[];
};

/* Messages delivered in order by one thread, each kept at the head until it is
 * delivered, so that a caller who finds the queue empty cannot overtake it. */
struct msgqueue {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    struct queued *head, *tail;
};

/* Counters: relaxed atomics, read by statistics(). */
#define COUNTERS(X) \
    X(requests) X(native_reads) X(native_bytes) X(native_device_bytes) X(forwarded_requests) X(forwarded_reads) \
    X(unpublished_reads) X(native_verify_failures) X(native_device_errors) X(native_reply_errors) \
    X(forwards_queued) X(forward_errors) X(replies_relayed) X(notifications_relayed) \
    X(reply_write_errors) X(interrupts_dropped) X(publications) X(withdrawals) X(read_errors)
#define DECLARE(name) _Atomic uint64_t name;

typedef struct {
    PyObject_HEAD
    int dev_fd, sock_fd, device_fd, ended_fd;
    struct kvfs_key_base keys;          /* the store's seed and key secret */
    int nthreads;
    uint16_t max_background;
    int running;
    atomic_int stopping;
    pthread_t *readers;
    int *fds;                           /* fds[0] = dev_fd, the others cloned from it */
    pthread_t relay, sender, notifier;
    _Atomic uint64_t init_unique;       /* 0 until the kernel's INIT is seen */
    _Atomic uint64_t init_flags;        /* what the kernel's INIT offered (flags | flags2 << 32) */
    atomic_int init_patched;
    pthread_rwlock_t table_lock;
    struct published *table[TABLE_BUCKETS];
    uint64_t published_files;           /* live versions */
    uint64_t kept_versions;             /* withdrawn versions still kept */
    struct published *withdrawn_head, *withdrawn_tail;
    uint64_t *freed_tokens;             /* tokens of the versions freed since Python last asked */
    size_t nfreed, freed_cap;
    /* Tests only (kvfs/base/crashpoints.py, stall point "native_read"): the first
     * native READ waits, its version in hand, until stall_dir/release exists. */
    atomic_int stall_armed;
    char stall_dir[4096];
    _Atomic uint64_t handed;            /* the highest unique a reader has read */
    _Atomic uint64_t *busy;             /* per reader: the unique it is serving, 0 when idle */
    /* Forwarding in the kernel's order (see forward()): one reader at a time
     * takes a request off /dev/fuse, and marks it undecided before the next may. */
    pthread_mutex_t read_lock;
    pthread_mutex_t order_lock;
    pthread_cond_t order_cond;
    uint64_t *undecided;                /* per reader: a request not yet forwarded nor served, or 0 */
    pthread_mutex_t pending_lock;
    struct pending *pending[TABLE_BUCKETS];
    struct msgqueue forwards;           /* requests for pyfuse3 that found the socket full */
    struct msgqueue notices;            /* pyfuse3's notifications, for the kernel */
    struct { COUNTERS(DECLARE) } n;
} Plane;

#define COUNT(p, name, v) atomic_fetch_add_explicit(&(p)->n.name, (v), memory_order_relaxed)

static inline unsigned bucket(uint64_t key) { return (unsigned)((key * 0x9E3779B97F4A7C15ull) >> 52) % TABLE_BUCKETS; }

/* -- forwarded requests: which descriptor a reply goes back on ------------ */

static void pending_put(Plane *p, uint64_t unique, int fd)
{
    struct pending *e = malloc(sizeof *e);
    if (e == NULL)
        return;                         /* its reply then goes on dev_fd: at worst ENOENT */
    e->unique = unique;
    e->fd = fd;
    pthread_mutex_lock(&p->pending_lock);
    e->next = p->pending[bucket(unique)];
    p->pending[bucket(unique)] = e;
    pthread_mutex_unlock(&p->pending_lock);
}

/* The descriptor that read `unique`, removed from the table if `take`; -1 if unknown. */
static int pending_fd(Plane *p, uint64_t unique, int take)
{
    int fd = -1;
    pthread_mutex_lock(&p->pending_lock);
    for (struct pending **at = &p->pending[bucket(unique)]; *at; at = &(*at)->next) {
        if ((*at)->unique == unique) {
            struct pending *e = *at;
            fd = e->fd;
            if (take) {
                *at = e->next;
                free(e);
            }
            break;
        }
    }
    pthread_mutex_unlock(&p->pending_lock);
    return fd;
}

/* -- queues: forwarding to pyfuse3 never blocks a reader, nor a notification the relay -- */

static void mq_init(struct msgqueue *q)
{
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
    q->head = q->tail = NULL;
}

/* Append a copy of buf (the caller holds q->lock); 0, or -1 without memory. */
static int mq_append_locked(struct msgqueue *q, const char *buf, size_t len)
{
    struct queued *m = malloc(sizeof *m + len);
    if (m == NULL)
        return -1;
    m->next = NULL;
    m->len = len;
    memcpy(m->data, buf, len);
    if (q->tail)
        q->tail->next = m;
    else
        q->head = m;
    q->tail = m;
    pthread_cond_signal(&q->cond);
    return 0;
}

static void mq_free(struct msgqueue *q)
{
    while (q->head) {
        struct queued *m = q->head;
        q->head = m->next;
        free(m);
    }
    q->tail = NULL;
}

/* Deliver q's messages in order until stopping (blocking in deliver is fine:
 * only this thread waits). */
static void mq_drain(Plane *p, struct msgqueue *q, int (*deliver)(Plane *, const struct queued *))
{
    pthread_mutex_lock(&q->lock);
    for (;;) {
        while (q->head == NULL && !atomic_load(&p->stopping))
            pthread_cond_wait(&q->cond, &q->lock);
        if (q->head == NULL)
            break;
        struct queued *m = q->head;
        pthread_mutex_unlock(&q->lock);
        deliver(p, m);
        pthread_mutex_lock(&q->lock);
        q->head = m->next;
        if (q->head == NULL)
            q->tail = NULL;
        free(m);
    }
    pthread_mutex_unlock(&q->lock);
}

static void send_to_python(Plane *p, const char *buf, size_t len)
{
    struct msgqueue *q = &p->forwards;
    pthread_mutex_lock(&q->lock);
    if (q->head == NULL) {
        ssize_t r = send(p->sock_fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r == (ssize_t)len) {
            pthread_mutex_unlock(&q->lock);
            return;
        }
        if (r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) {
            COUNT(p, forward_errors, 1);    /* pyfuse3 is gone: nobody will answer */
            pthread_mutex_unlock(&q->lock);
            return;
        }
    }
    if (mq_append_locked(q, buf, len) < 0)
        COUNT(p, forward_errors, 1);
    else
        COUNT(p, forwards_queued, 1);
    pthread_mutex_unlock(&q->lock);
}

static int deliver_forward(Plane *p, const struct queued *m)
{
    ssize_t r;
    do
        r = send(p->sock_fd, m->data, m->len, MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR && !atomic_load(&p->stopping));
    if (r != (ssize_t)m->len)
        COUNT(p, forward_errors, 1);
    return 0;
}

/* A notification may block in the kernel (an entry invalidation waits for the
 * directory's lock, which a caller of a request pyfuse3 has not answered may
 * hold): so the relay only queues it, and this thread waits. */
static int deliver_notice(Plane *p, const struct queued *m)
{
    ssize_t r;
    do
        r = write(p->dev_fd, m->data, m->len);
    while (r < 0 && errno == EINTR && !atomic_load(&p->stopping));
    if (r < 0)
        COUNT(p, reply_write_errors, 1);   /* ENOENT: the kernel holds nothing of that inode */
    return 0;
}

static void *sender_main(void *arg)
{
    Plane *p = arg;
    mq_drain(p, &p->forwards, deliver_forward);
    return NULL;
}

static void *notifier_main(void *arg)
{
    Plane *p = arg;
    mq_drain(p, &p->notices, deliver_notice);
    return NULL;
}

/* -- the kernel's order ------------------------------------------------------
 * pyfuse3 must see requests in the order the kernel queued them (their
 * uniques grow in that order): kvfs's O_TRUNC window answers a READ the kernel
 * sent before an O_TRUNC open from the old content only until a request of
 * the truncating descriptor arrives (kvfs/namespace/truncation.py), and that
 * holds only if the READ reaches pyfuse3 first. Readers take requests off
 * /dev/fuse one at a time (read_lock), each marking its request undecided
 * before the next reader may take one; a request is forwarded only when no
 * other reader holds an undecided request with a smaller unique. A READ is
 * decided as soon as its published version is found (serve_read), so
 * forwarding never waits for a device read. One exception is left: a native
 * READ whose device read or check fails goes to pyfuse3 late, possibly after
 * later requests (a damaged device: pyfuse3 reads and checks the block again).
 * A change under a READ in hand cannot cause that: the version's blocks stay
 * pinned until it is freed (see struct published). */

static void order_mark(Plane *p, int reader, uint64_t unique)
{
    pthread_mutex_lock(&p->order_lock);
    p->undecided[reader] = unique;
    pthread_mutex_unlock(&p->order_lock);
}

static void order_clear_locked(Plane *p, int reader)
{
    if (p->undecided[reader]) {
        p->undecided[reader] = 0;
        pthread_cond_broadcast(&p->order_cond);
    }
}

static void order_clear(Plane *p, int reader)
{
    pthread_mutex_lock(&p->order_lock);
    order_clear_locked(p, reader);
    pthread_mutex_unlock(&p->order_lock);
}

/* Wait (holding order_lock) until no other reader holds an undecided request older than `unique`. */
static void order_wait_turn_locked(Plane *p, int reader, uint64_t unique)
{
    for (;;) {
        int older = 0;
        for (int i = 0; i < p->nthreads && !older; i++)
            older = i != reader && p->undecided[i] && p->undecided[i] < unique;
        if (!older || atomic_load(&p->stopping))
            return;
        pthread_cond_wait(&p->order_cond, &p->order_lock);
    }
}

static void forward(Plane *p, int fd, int reader, const char *buf, size_t len)
{
    const struct fuse_in_header *in = (const void *)buf;
    COUNT(p, forwarded_requests, 1);
    pthread_mutex_lock(&p->order_lock);
    if (len >= sizeof *in)
        order_wait_turn_locked(p, reader, in->unique);
    order_clear_locked(p, reader);      /* sent below, before anyone else may send */
    if (len >= sizeof *in) {
        if (in->opcode == FUSE_INTERRUPT) {
            /* Only pyfuse3's own requests can be interrupted there; a native
             * READ finishes on its own. Forwarding the others would leave
             * them in libfuse's interrupt list for ever. */
            const struct fuse_interrupt_in *ii = (const void *)(in + 1);
            if (len < sizeof *in + sizeof *ii || pending_fd(p, ii->unique, 0) < 0) {
                COUNT(p, interrupts_dropped, 1);
                pthread_mutex_unlock(&p->order_lock);
                return;
            }
        } else if (in->opcode != FUSE_FORGET && in->opcode != FUSE_BATCH_FORGET
                   && in->opcode != FUSE_NOTIFY_REPLY) {
            pending_put(p, in->unique, fd);     /* these three have no reply */
        }
    }
    send_to_python(p, buf, len);        /* never blocks: a full socket queues it, in order */
    pthread_mutex_unlock(&p->order_lock);
}

/* -- native READs ---------------------------------------------------------- */

struct reader_state {
    struct kvfs_block_check *checks, *reads;
    uint8_t **bufs, *ok;
    uint8_t *data;                      /* 4096-aligned, `capacity` bytes */
    size_t max_blocks, capacity;
    struct iovec iov[MAX_IOV];
};

static int reserve(struct reader_state *s, size_t nblocks, size_t bytes)
{
    if (nblocks > s->max_blocks) {
        void *a = realloc(s->checks, nblocks * sizeof *s->checks);
        if (a) s->checks = a;
        void *b = realloc(s->reads, nblocks * sizeof *s->reads);
        if (b) s->reads = b;
        void *c = realloc(s->bufs, nblocks * sizeof *s->bufs);
        if (c) s->bufs = c;
        void *d = realloc(s->ok, nblocks);
        if (d) s->ok = d;
        if (!a || !b || !c || !d)
            return -1;
        s->max_blocks = nblocks;
    }
    if (bytes > s->capacity) {
        void *m;
        if (posix_memalign(&m, KVFS_SECTOR, bytes))
            return -1;
        free(s->data);
        s->data = m;
        s->capacity = bytes;
    }
    return 0;
}

#define LIVE UINT64_MAX

/* The live version of nodeid, or NULL. */
static struct published *find_live(Plane *p, uint64_t nodeid)
{
    for (struct published *f = p->table[bucket(nodeid)]; f; f = f->next)
        if (f->nodeid == nodeid && f->until == LIVE)
            return f;
    return NULL;
}

/* The version of nodeid that was its content when READ `unique` was handed out, or NULL. */
static struct published *find_for(Plane *p, uint64_t nodeid, uint64_t unique)
{
    for (struct published *f = p->table[bucket(nodeid)]; f; f = f->next)
        if (f->nodeid == nodeid && f->from < unique && unique <= f->until)
            return f;
    return NULL;
}

/* The test stall point: say so in stall_dir/stalled, then wait for stall_dir/release. */
static void stall_here(Plane *p)
{
    char path[sizeof p->stall_dir];
    snprintf(path, sizeof path, "%s/stalled", p->stall_dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0)
        close(fd);
    snprintf(path, sizeof path, "%s/release", p->stall_dir);
    while (access(path, F_OK) != 0 && !atomic_load(&p->stopping))
        usleep(10000);
}

/* Serve a READ natively: 1 if answered, 0 if it must go to pyfuse3. */
static int serve_read(Plane *p, int fd, int reader, const struct fuse_in_header *in, size_t len,
                      struct reader_state *s)
{
    const struct fuse_read_in *r = (const void *)(in + 1);
    if (len < sizeof *in + sizeof *r)
        return 0;
    uint64_t off = r->offset, end = r->offset + r->size;
    uint32_t bs;
    size_t first = 0, nb = 0;

    pthread_rwlock_rdlock(&p->table_lock);
    struct published *f = find_for(p, in->nodeid, in->unique);
    if (f == NULL) {
        pthread_rwlock_unlock(&p->table_lock);
        COUNT(p, unpublished_reads, 1);
        return 0;
    }
    bs = f->block_size;
    if (end > f->size)
        end = f->size;
    if (end > off) {
        first = off / bs;
        nb = (end - 1) / bs - first + 1;
        if (reserve(s, nb, nb * kvfs_span(bs)) < 0) {
            pthread_rwlock_unlock(&p->table_lock);
            return 0;
        }
        for (size_t i = 0; i < nb; i++) {
            if (first + i < f->nblocks) {
                s->checks[i] = f->blocks[first + i];
            } else {
                memset(&s->checks[i], 0, sizeof s->checks[i]);
                s->checks[i].dev_off = HOLE;    /* trailing holes are implied by the size */
            }
        }
    }
    pthread_rwlock_unlock(&p->table_lock);
    order_clear(p, reader);             /* decided: later requests need not wait for the device */
    if (atomic_load_explicit(&p->stall_armed, memory_order_relaxed) && atomic_exchange(&p->stall_armed, 0))
        stall_here(p);

    size_t nreads = 0;
    for (size_t i = 0; i < nb; i++) {
        if (s->checks[i].dev_off != HOLE) {
            s->reads[nreads] = s->checks[i];
            s->bufs[nreads] = s->data + i * kvfs_span(bs);
            nreads++;
        }
    }
    if (nreads) {
        int bad = kvfs_read_verified_keyed(p->device_fd, &p->keys, s->reads, nreads, s->bufs, s->ok);
        if (bad >= 0) {
            uint64_t span = 0;
            for (size_t i = 0; i < nreads; i++)
                span += kvfs_span(s->reads[i].length);
            COUNT(p, native_device_bytes, span);
        }
        if (bad < 0) {
            COUNT(p, native_device_errors, 1);
            return 0;
        }
        if (bad > 0) {
            COUNT(p, native_verify_failures, 1);
            return 0;
        }
    }

    struct fuse_out_header out = {
        .len = (uint32_t)(sizeof out + (end > off ? end - off : 0)), .error = 0, .unique = in->unique};
    int n = 0;
    s->iov[n++] = (struct iovec){&out, sizeof out};
    for (size_t i = 0; i < nb; i++) {
        uint64_t start = (uint64_t)(first + i) * bs;
        uint64_t lo = (off > start ? off : start) - start;
        uint64_t hi = (end < start + bs ? end : start + bs) - start;
        uint64_t stored = s->checks[i].dev_off == HOLE ? 0 : s->checks[i].length;
        if (lo < stored) {              /* bytes that were read and verified */
            uint64_t upto = hi < stored ? hi : stored;
            s->iov[n++] = (struct iovec){s->data + i * kvfs_span(bs) + lo, upto - lo};
            lo = upto;
        }
        while (lo < hi) {               /* past a short block's end, or a hole: zeros */
            if (n >= MAX_IOV)
                return 0;
            uint64_t piece = hi - lo < ZERO_CHUNK ? hi - lo : ZERO_CHUNK;
            s->iov[n++] = (struct iovec){(void *)zeros, piece};
            lo += piece;
        }
        if (n >= MAX_IOV - 1)
            return 0;
    }
    if (writev(fd, s->iov, n) < 0)
        COUNT(p, native_reply_errors, 1);   /* ENOENT: the caller was interrupted meanwhile */
    COUNT(p, native_reads, 1);
    COUNT(p, native_bytes, end > off ? end - off : 0);
    return 1;
}

/* -- the threads ------------------------------------------------------------ */

static void signal_ended(Plane *p)
{
    uint64_t one = 1;
    if (write(p->ended_fd, &one, sizeof one) < 0) {
        /* the counter cannot overflow with one write per reader */
    }
}

struct reader_arg {
    Plane *plane;
    int index;
};

static void *reader_main(void *arg)
{
    struct reader_arg *ra = arg;
    Plane *p = ra->plane;
    int fd = p->fds[ra->index];
    int ra_index = ra->index;
    free(ra);
    char *buf = malloc(REQUEST_BUFFER);
    struct reader_state s = {0};
    if (buf == NULL) {
        signal_ended(p);
        return NULL;
    }
    while (!atomic_load(&p->stopping)) {
        pthread_mutex_lock(&p->read_lock);
        if (atomic_load(&p->stopping)) {
            pthread_mutex_unlock(&p->read_lock);
            break;
        }
        ssize_t len = read(fd, buf, REQUEST_BUFFER);
        int read_errno = errno;
        const struct fuse_in_header *in = (const void *)buf;
        if (len >= (ssize_t)sizeof *in) {
            order_mark(p, ra_index, in->unique);
            atomic_store(&p->busy[ra_index], in->unique);
            uint64_t seen = atomic_load(&p->handed);
            while (in->unique > seen && !atomic_compare_exchange_weak(&p->handed, &seen, in->unique))
                ;
        }
        pthread_mutex_unlock(&p->read_lock);
        errno = read_errno;
        if (len < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;               /* ENOENT: the request was interrupted before we read it */
            if (errno != ENODEV)
                COUNT(p, read_errors, 1);
            signal_ended(p);            /* ENODEV: unmounted or aborted */
            break;
        }
        COUNT(p, requests, 1);
        if ((size_t)len >= sizeof *in) {
            if (in->opcode == FUSE_READ) {
                if (serve_read(p, fd, ra_index, in, (size_t)len, &s)) {
                    atomic_store(&p->busy[ra_index], 0);
                    continue;
                }
                COUNT(p, forwarded_reads, 1);
            } else if (in->opcode == FUSE_INIT && (size_t)len >= sizeof *in + sizeof(struct fuse_init_in)) {
                const struct fuse_init_in *ii = (const void *)(in + 1);
                uint64_t flags = ii->flags;
                if (flags & FUSE_INIT_EXT)
                    flags |= (uint64_t)ii->flags2 << 32;
                atomic_store(&p->init_flags, flags);
                atomic_store(&p->init_unique, in->unique);
            }
        }
        forward(p, fd, ra_index, buf, (size_t)len);
        atomic_store(&p->busy[ra_index], 0);
    }
    free(buf);
    free(s.checks);
    free(s.reads);
    free(s.bufs);
    free(s.ok);
    free(s.data);
    return NULL;
}

/* pyfuse3's INIT reply leaves max_background at 0 (the kernel then allows 12
 * background requests, readahead included); raise it here. And accept shared
 * mmap of direct_io files where the kernel offers it. */
static void patch_init(Plane *p, char *buf, size_t len)
{
    struct fuse_out_header *out = (void *)buf;
    struct fuse_init_out *io = (void *)(out + 1);
    if (out->error != 0 || len < sizeof *out + offsetof(struct fuse_init_out, max_write))
        return;
    if (p->max_background) {
        io->max_background = p->max_background;
        io->congestion_threshold = (uint16_t)(p->max_background * 3 / 4);
    }
    if ((atomic_load(&p->init_flags) & FUSE_DIRECT_IO_ALLOW_MMAP) && (io->flags & FUSE_INIT_EXT)
            && len >= sizeof *out + offsetof(struct fuse_init_out, flags2) + sizeof io->flags2)
        io->flags2 |= (uint32_t)(FUSE_DIRECT_IO_ALLOW_MMAP >> 32);
}

static void *relay_main(void *arg)
{
    Plane *p = arg;
    char *buf = malloc(REPLY_BUFFER);
    if (buf == NULL)
        return NULL;
    for (;;) {
        ssize_t len = recv(p->sock_fd, buf, REPLY_BUFFER, MSG_TRUNC);
        if (len < 0 && errno == EINTR)
            continue;
        if (len <= 0)
            break;                      /* pyfuse3 closed its end, or stop() shut ours */
        if ((size_t)len > REPLY_BUFFER || (size_t)len < sizeof(struct fuse_out_header)) {
            COUNT(p, reply_write_errors, 1);
            continue;
        }
        struct fuse_out_header *out = (void *)buf;
        int fd;
        if (out->unique == 0) {         /* a notification: any descriptor, from the notifier */
            pthread_mutex_lock(&p->notices.lock);
            if (mq_append_locked(&p->notices, buf, (size_t)len) < 0)
                COUNT(p, reply_write_errors, 1);
            pthread_mutex_unlock(&p->notices.lock);
            COUNT(p, notifications_relayed, 1);
            continue;
        } else {
            /* an interrupt's reply goes where the interrupted request was read */
            int is_interrupt_reply = (out->unique & FUSE_INT_REQ_BIT) != 0;
            fd = pending_fd(p, out->unique & ~(uint64_t)FUSE_INT_REQ_BIT, !is_interrupt_reply);
            if (fd < 0)
                fd = p->dev_fd;
            if (out->unique == atomic_load(&p->init_unique) && !atomic_exchange(&p->init_patched, 1))
                patch_init(p, buf, (size_t)len);
            COUNT(p, replies_relayed, 1);
        }
        if (write(fd, buf, (size_t)len) < 0)
            COUNT(p, reply_write_errors, 1);    /* ENOENT: interrupted, or no such inode */
    }
    free(buf);
    return NULL;
}

static void wake_handler(int sig) { (void)sig; }

/* -- the Python type --------------------------------------------------------- */

static int Plane_init(Plane *p, PyObject *args, PyObject *kw)
{
    static char *names[] = {"dev_fd", "sock_fd", "device_fd", "seed", "secret", "threads", "max_background",
                            "stall_dir", NULL};
    unsigned long long seed;
    const char *secret, *stall_dir = NULL;
    Py_ssize_t secret_len;
    int threads, max_background;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiKy#ii|z", names, &p->dev_fd, &p->sock_fd, &p->device_fd,
                                     &seed, &secret, &secret_len, &threads, &max_background, &stall_dir))
        return -1;
    if (stall_dir != NULL) {
        if (strlen(stall_dir) > sizeof p->stall_dir - 16 || !*stall_dir) {
            PyErr_SetString(PyExc_ValueError, "stall_dir is too long or empty");
            return -1;
        }
        strcpy(p->stall_dir, stall_dir);
        atomic_store(&p->stall_armed, 1);
    }
    if (kvfs_key_base_init(&p->keys, seed, (const uint8_t *)secret, (size_t)secret_len) < 0) {
        PyErr_SetString(PyExc_ValueError, "the key secret is at most 32 bytes");
        return -1;
    }
    if (threads < 1 || threads > 64) {
        PyErr_SetString(PyExc_ValueError, "threads must be between 1 and 64");
        return -1;
    }
    if (max_background < 0 || max_background > 65535) {
        PyErr_SetString(PyExc_ValueError, "max_background must be between 0 and 65535");
        return -1;
    }
    p->nthreads = threads;
    p->max_background = (uint16_t)max_background;
    p->busy = calloc((size_t)threads, sizeof *p->busy);
    p->undecided = calloc((size_t)threads, sizeof *p->undecided);
    if (p->busy == NULL || p->undecided == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    p->ended_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (p->ended_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_rwlock_init(&p->table_lock, NULL);
    pthread_mutex_init(&p->pending_lock, NULL);
    pthread_mutex_init(&p->read_lock, NULL);
    pthread_mutex_init(&p->order_lock, NULL);
    pthread_cond_init(&p->order_cond, NULL);
    mq_init(&p->forwards);
    mq_init(&p->notices);
    return 0;
}

static PyObject *Plane_start(Plane *p, PyObject *noargs)
{
    if (p->running || p->readers) {
        PyErr_SetString(PyExc_RuntimeError, "the read plane was started already");
        return NULL;
    }
    struct sigaction sa = {.sa_handler = wake_handler};   /* no SA_RESTART: read() returns EINTR */
    sigemptyset(&sa.sa_mask);
    if (sigaction(WAKE_SIGNAL, &sa, NULL) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    p->fds = calloc((size_t)p->nthreads, sizeof *p->fds);
    p->readers = calloc((size_t)p->nthreads, sizeof *p->readers);
    if (!p->fds || !p->readers || !p->busy)
        return PyErr_NoMemory();
    p->fds[0] = p->dev_fd;
    for (int i = 1; i < p->nthreads; i++) {
        p->fds[i] = open("/dev/fuse", O_RDWR | O_CLOEXEC);
        uint32_t master = (uint32_t)p->dev_fd;
        if (p->fds[i] < 0 || ioctl(p->fds[i], FUSE_DEV_IOC_CLONE, &master) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            for (int j = 1; j <= i; j++)
                if (p->fds[j] >= 0)
                    close(p->fds[j]);
            free(p->fds);
            free(p->readers);
            p->fds = NULL;
            p->readers = NULL;
            return NULL;
        }
    }
    p->running = 1;
    pthread_create(&p->relay, NULL, relay_main, p);
    pthread_create(&p->sender, NULL, sender_main, p);
    pthread_create(&p->notifier, NULL, notifier_main, p);
    for (int i = 0; i < p->nthreads; i++) {
        struct reader_arg *ra = malloc(sizeof *ra);
        ra->plane = p;
        ra->index = i;
        pthread_create(&p->readers[i], NULL, reader_main, ra);
    }
    Py_RETURN_NONE;
}

/* Join threads[0] of `n` threads that may be blocked in a read or write of
 * /dev/fuse: those sleep until a request or a signal, so poke them until it has
 * seen `stopping`. All n are poked: threads[0] may be waiting for read_lock,
 * held by another reader asleep in read(). */
static void join_poking(pthread_t *threads, int n)
{
    for (;;) {
        for (int i = 0; i < n; i++)
            pthread_kill(threads[i], WAKE_SIGNAL);
        pthread_t thread = threads[0];
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 20 * 1000 * 1000;
        if (t.tv_nsec >= 1000000000) {
            t.tv_sec++;
            t.tv_nsec -= 1000000000;
        }
        if (pthread_timedjoin_np(thread, NULL, &t) == 0)
            return;
    }
}

static void stop_threads(Plane *p)
{
    atomic_store(&p->stopping, 1);
    pthread_mutex_lock(&p->order_lock);
    pthread_cond_broadcast(&p->order_cond);     /* a reader may wait for its turn to forward */
    pthread_mutex_unlock(&p->order_lock);
    for (int i = 0; i < p->nthreads; i++)
        join_poking(p->readers + i, p->nthreads - i);
    shutdown(p->sock_fd, SHUT_RD);
    pthread_join(p->relay, NULL);
    struct msgqueue *queues[] = {&p->forwards, &p->notices};
    for (int i = 0; i < 2; i++) {
        pthread_mutex_lock(&queues[i]->lock);
        pthread_cond_broadcast(&queues[i]->cond);
        pthread_mutex_unlock(&queues[i]->lock);
    }
    /* The sender may be blocked in send() to a pyfuse3 that reads no more. */
    shutdown(p->sock_fd, SHUT_WR);
    pthread_join(p->sender, NULL);
    join_poking(&p->notifier, 1);           /* it may sit in a write the kernel holds */
    for (int i = 1; i < p->nthreads; i++)
        close(p->fds[i]);
}

static PyObject *Plane_stop(Plane *p, PyObject *noargs)
{
    if (!p->running)
        Py_RETURN_NONE;
    p->running = 0;
    Py_BEGIN_ALLOW_THREADS
    stop_threads(p);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int parse_block(PyObject *item, struct kvfs_block_check *b)
{
    memset(b, 0, sizeof *b);
    if (item == Py_None) {
        b->dev_off = HOLE;
        return 0;
    }
    unsigned long long off;
    unsigned int length;
    const char *key, *salt;
    Py_ssize_t key_len, salt_len;
    if (!PyArg_ParseTuple(item, "KIy#y#", &off, &length, &key, &key_len, &salt, &salt_len))
        return -1;
    if (key_len != KVFS_KEY_BYTES || (salt_len != 0 && salt_len != KVFS_SALT_BYTES) || off % KVFS_SECTOR
            || off == HOLE) {
        PyErr_SetString(PyExc_ValueError, "a block is (sector-aligned offset, length, 16-byte key, 0 or 8 salt bytes)");
        return -1;
    }
    b->dev_off = off;
    b->length = length;
    memcpy(b->key, key, KVFS_KEY_BYTES);
    b->salted = salt_len != 0;
    if (salt_len)
        memcpy(b->salt, salt, KVFS_SALT_BYTES);
    return 0;
}

/* End the live version of nodeid (the caller holds the write lock): READs handed
 * out from now on go to pyfuse3; those handed out before may still use it. */
static int withdraw_live(Plane *p, uint64_t nodeid)
{
    struct published *f = find_live(p, nodeid);
    if (f == NULL)
        return 0;
    f->until = atomic_load(&p->handed);
    f->next_withdrawn = NULL;
    if (p->withdrawn_tail)
        p->withdrawn_tail->next_withdrawn = f;
    else
        p->withdrawn_head = f;
    p->withdrawn_tail = f;
    p->published_files--;
    p->kept_versions++;
    return 1;
}

static void unlink_version(Plane *p, struct published *f)
{
    for (struct published **at = &p->table[bucket(f->nodeid)]; *at; at = &(*at)->next) {
        if (*at == f) {
            *at = f->next;
            return;
        }
    }
}

/* Free the withdrawn versions no reader can still need: every READ handed out
 * up to their `until` has been served (the write lock is held). A reader marks
 * itself busy before it lets the next reader take a request, and before
 * `handed` grows past its request: so a version valid for a READ in hand is
 * never collected under it. */
static void collect_versions(Plane *p)
{
    uint64_t oldest_busy = atomic_load(&p->handed) + 1;
    for (int i = 0; i < p->nthreads; i++) {
        uint64_t u = atomic_load(&p->busy[i]);
        if (u && u < oldest_busy)
            oldest_busy = u;
    }
    while (p->withdrawn_head && p->withdrawn_head->until < oldest_busy) {
        struct published *f = p->withdrawn_head;
        if (p->nfreed == p->freed_cap) {
            /* Its token must reach Python, or its pins would stay for ever: on no
             * memory it stays kept, and the next collection tries again. */
            size_t cap = p->freed_cap ? 2 * p->freed_cap : 64;
            uint64_t *grown = realloc(p->freed_tokens, cap * sizeof *grown);
            if (grown == NULL)
                return;
            p->freed_tokens = grown;
            p->freed_cap = cap;
        }
        p->freed_tokens[p->nfreed++] = f->token;
        p->withdrawn_head = f->next_withdrawn;
        if (p->withdrawn_head == NULL)
            p->withdrawn_tail = NULL;
        unlink_version(p, f);
        free(f);
        p->kept_versions--;
    }
}

static PyObject *Plane_publish(Plane *p, PyObject *args)
{
    unsigned long long nodeid, generation, size, token;
    unsigned int block_size;
    PyObject *blocks;
    if (!PyArg_ParseTuple(args, "KKKIOK", &nodeid, &generation, &size, &block_size, &blocks, &token))
        return NULL;
    PyObject *seq = PySequence_Fast(blocks, "blocks must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (block_size == 0 || block_size % KVFS_SECTOR || (uint64_t)n > (size + block_size - 1) / block_size) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "block_size must be a multiple of 4096 and blocks cover at most size bytes");
        return NULL;
    }
    struct published *f = malloc(sizeof *f + (size_t)n * sizeof f->blocks[0]);
    if (f == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_block(PySequence_Fast_GET_ITEM(seq, i), &f->blocks[i]) < 0
                || (f->blocks[i].dev_off != HOLE && f->blocks[i].length > block_size)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a block is longer than the block size");
            free(f);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    f->nodeid = nodeid;
    f->generation = generation;
    f->token = token;
    f->size = size;
    f->block_size = block_size;
    f->nblocks = (uint32_t)n;
    pthread_rwlock_wrlock(&p->table_lock);
    struct published *live = find_live(p, nodeid);
    if (live != NULL && live->generation == generation && live->size == size) {
        pthread_rwlock_unlock(&p->table_lock);     /* already published as it is */
        free(f);
        Py_RETURN_FALSE;
    }
    withdraw_live(p, nodeid);
    f->from = atomic_load(&p->handed);
    f->until = LIVE;
    f->next_withdrawn = NULL;
    f->next = p->table[bucket(nodeid)];
    p->table[bucket(nodeid)] = f;
    p->published_files++;
    collect_versions(p);
    pthread_rwlock_unlock(&p->table_lock);
    COUNT(p, publications, 1);
    Py_RETURN_TRUE;
}

static PyObject *Plane_withdraw(Plane *p, PyObject *arg)
{
    unsigned long long nodeid = PyLong_AsUnsignedLongLong(arg);
    if (nodeid == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    pthread_rwlock_wrlock(&p->table_lock);
    int removed = withdraw_live(p, nodeid);
    collect_versions(p);
    pthread_rwlock_unlock(&p->table_lock);
    if (removed)
        COUNT(p, withdrawals, 1);
    return PyBool_FromLong(removed);
}

/* Collect what no READ can still need; the tokens of every version freed since
 * the last call, so that Python lets go of their pins. */
static PyObject *Plane_collect(Plane *p, PyObject *noargs)
{
    pthread_rwlock_wrlock(&p->table_lock);
    collect_versions(p);
    PyObject *tokens = PyList_New((Py_ssize_t)p->nfreed);
    for (size_t i = 0; tokens != NULL && i < p->nfreed; i++) {
        PyObject *t = PyLong_FromUnsignedLongLong(p->freed_tokens[i]);
        if (t == NULL) {
            Py_CLEAR(tokens);
            break;
        }
        PyList_SET_ITEM(tokens, (Py_ssize_t)i, t);
    }
    if (tokens != NULL)
        p->nfreed = 0;                              /* else they are handed over next time */
    pthread_rwlock_unlock(&p->table_lock);
    return tokens;
}

#define ADD_COUNTER(name) \
    if (put(d, #name, atomic_load_explicit(&p->n.name, memory_order_relaxed)) < 0) goto fail;

static int put(PyObject *d, const char *name, uint64_t v)
{
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    int r = o ? PyDict_SetItemString(d, name, o) : -1;
    Py_XDECREF(o);
    return r;
}

static PyObject *Plane_statistics(Plane *p, PyObject *noargs)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    COUNTERS(ADD_COUNTER)
    pthread_rwlock_rdlock(&p->table_lock);
    uint64_t files = p->published_files, kept = p->kept_versions;
    pthread_rwlock_unlock(&p->table_lock);
    if (put(d, "published_files", files) < 0 || put(d, "threads", (uint64_t)p->nthreads) < 0
            || put(d, "kept_versions", kept) < 0)
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static void Plane_dealloc(Plane *p)
{
    if (p->running) {
        p->running = 0;
        stop_threads(p);
    }
    for (unsigned i = 0; i < TABLE_BUCKETS; i++) {
        while (p->table[i]) {
            struct published *f = p->table[i];
            p->table[i] = f->next;
            free(f);
        }
        while (p->pending[i]) {
            struct pending *e = p->pending[i];
            p->pending[i] = e->next;
            free(e);
        }
    }
    mq_free(&p->forwards);
    mq_free(&p->notices);
    if (p->ended_fd > 0)
        close(p->ended_fd);
    free(p->fds);
    free(p->readers);
    free((void *)p->busy);
    free(p->undecided);
    free(p->freed_tokens);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef Plane_methods[] = {
    {"start", (PyCFunction)Plane_start, METH_NOARGS, "Clone the descriptors and start the threads."},
    {"stop", (PyCFunction)Plane_stop, METH_NOARGS, "Stop and join every thread (closes the cloned descriptors)."},
    {"publish", (PyCFunction)Plane_publish, METH_VARARGS,
     "publish(nodeid, generation, size, block_size, blocks, token): serve this file's READs natively.\n"
     "blocks: per block in file order (device offset, length, key, salt) or None for a hole.\n"
     "True if published; False if this generation already was (the token is not kept).\n"
     "collect() hands the token back once the version is freed."},
    {"collect", (PyCFunction)Plane_collect, METH_NOARGS,
     "Free the withdrawn versions no READ in hand can need; the tokens of every version freed since the last call."},
    {"withdraw", (PyCFunction)Plane_withdraw, METH_O, "withdraw(nodeid): READs of it go to pyfuse3 again; True if it was published."},
    {"statistics", (PyCFunction)Plane_statistics, METH_NOARGS, "The counters, as a dict."},
    {NULL}
};

static PyObject *Plane_ended_fd(Plane *p, void *closure) { return PyLong_FromLong(p->ended_fd); }

static PyGetSetDef Plane_getset[] = {
    {"ended_fd", (getter)Plane_ended_fd, NULL, "an eventfd that becomes readable once the connection has ended", NULL},
    {NULL}
};

static PyTypeObject PlaneType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.fuse._readplane.ReadPlane",
    .tp_basicsize = sizeof(Plane),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ReadPlane(dev_fd, sock_fd, device_fd, seed, secret, threads, max_background): see readplane.c",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plane_init,
    .tp_dealloc = (destructor)Plane_dealloc,
    .tp_methods = Plane_methods,
    .tp_getset = Plane_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_readplane",
                                    "The native read plane beside pyfuse3 (see readplane.c).", -1, NULL};

PyMODINIT_FUNC PyInit__readplane(void)
{
    if (PyType_Ready(&PlaneType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PlaneType);
    if (PyModule_AddObject(m, "ReadPlane", (PyObject *)&PlaneType) < 0) {
        Py_DECREF(&PlaneType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
