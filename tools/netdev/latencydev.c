/*
 * latencydev: an emulated networked-flash namespace for kvfs-bench netdev.
 *
 * A FUSE filesystem (libfuse 3 low-level API) whose root directory holds one
 * regular file, "namespace", of a fixed size, kept in RAM.  Every read and
 * write is answered after a fixed latency: the thread serving the request
 * sleeps, so requests overlap only as far as there are threads to sleep in.
 * With many threads, async direct I/O and max_background 128, a loop device in
 * direct-I/O mode on that file (losetup --direct-io=on) keeps many requests in
 * flight, and its throughput grows with queue depth as on NVMe-oF.
 *
 *   latencydev --size BYTES --latency-us N [--threads N] [--prefault] [--page-cache] MOUNTPOINT
 *
 * --prefault allocates all of the RAM at start, so that a first write to a
 * region costs no page faults in the daemon (a real device has no such cost).
 *
 * --page-cache opens the file without direct_io, so that buffered reads go
 * through the kernel's page cache as on any FUSE filesystem.  With latency 0
 * this is the FUSE floor of kvfs-bench netdev: a multi-threaded C server that
 * does no work but copy from RAM, read with the benchmark's own reader passes.
 *
 * Runs in the foreground.  Prints "mounted" on stdout once mounted, then an
 * "init ..." line with what it asked the kernel for once the kernel's INIT
 * request has been answered (from then on it serves requests).  Exits 0
 * when the filesystem is unmounted (umount, fusermount3 -u) or on SIGTERM,
 * SIGINT or SIGHUP (then it unmounts itself).
 *
 * On SIGUSR1 it prints what it served since the last SIGUSR1 (or the start):
 *   "stats reads=N writes=N read_bytes=N written_bytes=N max_in_flight=N"
 * where max_in_flight is the most reads and writes it had in hand at once
 * (waiting their latency side by side).  The tests use it to see overlap.
 */
#define FUSE_USE_VERSION 312
#define _GNU_SOURCE

#include <fuse_lowlevel.h>

#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define FILE_INO 2
#define FILE_NAME "namespace"
#define MAX_IO (1u << 20)          /* 1 MiB reads and writes per FUSE request */
#define MAX_BACKGROUND 128
#define ATTR_TIMEOUT 86400.0

static unsigned char *ram;         /* the namespace's contents */
static off_t dev_size;
static long long latency_ns;
static int page_cache;             /* --page-cache: opens without direct_io (the FUSE floor) */
static struct timespec start_time;

/* What SIGUSR1 reports; counted with atomics, from every serving thread. */
static unsigned long long n_reads, n_writes, read_bytes, written_bytes;
static long long in_flight, max_in_flight;

static void request_begins(void)
{
	long long now = __atomic_add_fetch(&in_flight, 1, __ATOMIC_SEQ_CST);
	long long seen = __atomic_load_n(&max_in_flight, __ATOMIC_SEQ_CST);

	while (now > seen &&
	       !__atomic_compare_exchange_n(&max_in_flight, &seen, now, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
		;
}

/* Called just before the reply: a request its caller has seen answered is counted. */
static void request_ends(unsigned long long *count, unsigned long long *bytes, size_t size)
{
	__atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST);
	__atomic_add_fetch(bytes, size, __ATOMIC_SEQ_CST);
	__atomic_sub_fetch(&in_flight, 1, __ATOMIC_SEQ_CST);
}

/* A thread of its own that takes SIGUSR1 (blocked in every other thread),
 * prints the counters and starts them again from zero. */
static void *stats_thread(void *arg)
{
	sigset_t *usr1 = arg;
	int sig;

	for (;;) {
		if (sigwait(usr1, &sig) != 0)
			continue;
		printf("stats reads=%llu writes=%llu read_bytes=%llu written_bytes=%llu max_in_flight=%lld\n",
		       __atomic_exchange_n(&n_reads, 0, __ATOMIC_SEQ_CST),
		       __atomic_exchange_n(&n_writes, 0, __ATOMIC_SEQ_CST),
		       __atomic_exchange_n(&read_bytes, 0, __ATOMIC_SEQ_CST),
		       __atomic_exchange_n(&written_bytes, 0, __ATOMIC_SEQ_CST),
		       __atomic_exchange_n(&max_in_flight, __atomic_load_n(&in_flight, __ATOMIC_SEQ_CST),
					   __ATOMIC_SEQ_CST));
		fflush(stdout);
	}
	return NULL;
}

static void wait_latency(void)
{
	struct timespec until;

	if (latency_ns <= 0)
		return;
	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += latency_ns / 1000000000LL;
	until.tv_nsec += latency_ns % 1000000000LL;
	if (until.tv_nsec >= 1000000000L) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000L;
	}
	/* An absolute deadline: a signal that interrupts the sleep does not
	 * shorten or lengthen the latency. */
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &until, NULL) == EINTR)
		;
}

static int fill_stat(fuse_ino_t ino, struct stat *st)
{
	memset(st, 0, sizeof(*st));
	st->st_ino = ino;
	st->st_uid = getuid();
	st->st_gid = getgid();
	st->st_atim = st->st_mtim = st->st_ctim = start_time;
	if (ino == FUSE_ROOT_ID) {
		st->st_mode = S_IFDIR | 0755;
		st->st_nlink = 2;
	} else if (ino == FILE_INO) {
		st->st_mode = S_IFREG | 0600;
		st->st_nlink = 1;
		st->st_size = dev_size;
		st->st_blksize = 4096;
		st->st_blocks = dev_size / 512;
	} else {
		return -1;
	}
	return 0;
}

static void ld_init(void *userdata, struct fuse_conn_info *conn)
{
	(void)userdata;
	if (conn->capable & FUSE_CAP_ASYNC_DIO)
		conn->want |= FUSE_CAP_ASYNC_DIO;
	if (conn->capable & FUSE_CAP_ASYNC_READ)
		conn->want |= FUSE_CAP_ASYNC_READ;
	/* The loop device keeps the page cache out of it; so do we. */
	conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
	conn->max_write = MAX_IO;
	conn->max_read = MAX_IO;
	conn->max_readahead = MAX_IO;
	conn->max_background = MAX_BACKGROUND;
	conn->congestion_threshold = MAX_BACKGROUND * 3 / 4;
	/* What we asked the kernel for, for the benchmark's report. */
	printf("init max_background=%u congestion_threshold=%u max_write=%u max_read=%u async_dio=%d\n",
	       conn->max_background, conn->congestion_threshold, conn->max_write, conn->max_read,
	       !!(conn->want & FUSE_CAP_ASYNC_DIO));
	fflush(stdout);
}

static void ld_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
	struct fuse_entry_param e;

	if (parent != FUSE_ROOT_ID || strcmp(name, FILE_NAME) != 0) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	memset(&e, 0, sizeof(e));
	e.ino = FILE_INO;
	e.attr_timeout = ATTR_TIMEOUT;
	e.entry_timeout = ATTR_TIMEOUT;
	fill_stat(FILE_INO, &e.attr);
	fuse_reply_entry(req, &e);
}

static void ld_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	struct stat st;

	(void)fi;
	if (fill_stat(ino, &st) != 0)
		fuse_reply_err(req, ENOENT);
	else
		fuse_reply_attr(req, &st, ATTR_TIMEOUT);
}

static void ld_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *attr, int to_set,
		       struct fuse_file_info *fi)
{
	struct stat st;

	(void)fi;
	if (fill_stat(ino, &st) != 0) {
		fuse_reply_err(req, ENOENT);
		return;
	}
	/* A namespace has a fixed size; times and modes are not kept. */
	if ((to_set & FUSE_SET_ATTR_SIZE) && (ino != FILE_INO || attr->st_size != dev_size)) {
		fuse_reply_err(req, EPERM);
		return;
	}
	fuse_reply_attr(req, &st, ATTR_TIMEOUT);
}

static void ld_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (ino != FILE_INO) {
		fuse_reply_err(req, ino == FUSE_ROOT_ID ? EISDIR : ENOENT);
		return;
	}
	/* Every request reaches us, O_DIRECT or not: no page cache in between.
	 * With --page-cache, buffered readers go through the kernel's page cache
	 * as they would on any FUSE filesystem (kvfs-bench netdev's FUSE floor),
	 * and what is cached stays across opens, as kvfs keeps a sealed file's. */
	fi->direct_io = !page_cache;
	fi->keep_cache = page_cache;
	fuse_reply_open(req, fi);
}

static void ld_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		    struct fuse_file_info *fi)
{
	(void)fi;
	if (ino != FILE_INO) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	request_begins();
	wait_latency();
	if (off >= dev_size)
		size = 0;
	else if ((off_t)size > dev_size - off)
		size = dev_size - off;
	request_ends(&n_reads, &read_bytes, size);
	fuse_reply_buf(req, size ? (const char *)ram + off : NULL, size);
}

static void ld_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size,
		     off_t off, struct fuse_file_info *fi)
{
	(void)fi;
	if (ino != FILE_INO) {
		fuse_reply_err(req, EISDIR);
		return;
	}
	request_begins();
	wait_latency();
	if (off >= dev_size) {
		request_ends(&n_writes, &written_bytes, 0);
		fuse_reply_err(req, ENOSPC);
		return;
	}
	if ((off_t)size > dev_size - off)
		size = dev_size - off;
	memcpy(ram + off, buf, size);
	request_ends(&n_writes, &written_bytes, size);
	fuse_reply_write(req, size);
}

static void ld_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi)
{
	(void)ino; (void)datasync; (void)fi;
	fuse_reply_err(req, 0);   /* RAM: every answered write is already "durable" */
}

static void ld_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	(void)ino; (void)fi;
	fuse_reply_err(req, 0);
}

static void ld_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
	if (ino != FUSE_ROOT_ID) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	fuse_reply_open(req, fi);
}

static void ld_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
		       struct fuse_file_info *fi)
{
	static const struct { const char *name; fuse_ino_t ino; } entries[] = {
		{ ".", FUSE_ROOT_ID }, { "..", FUSE_ROOT_ID }, { FILE_NAME, FILE_INO },
	};
	char buf[512];
	size_t used = 0;
	off_t i;

	(void)fi;
	if (ino != FUSE_ROOT_ID) {
		fuse_reply_err(req, ENOTDIR);
		return;
	}
	if (size > sizeof(buf))
		size = sizeof(buf);
	for (i = off; i < (off_t)(sizeof(entries) / sizeof(entries[0])); i++) {
		struct stat st;
		size_t need;

		fill_stat(entries[i].ino, &st);
		need = fuse_add_direntry(req, buf + used, size - used, entries[i].name, &st, i + 1);
		if (need > size - used)
			break;
		used += need;
	}
	fuse_reply_buf(req, buf, used);
}

static const struct fuse_lowlevel_ops ops = {
	.init = ld_init,
	.lookup = ld_lookup,
	.getattr = ld_getattr,
	.setattr = ld_setattr,
	.open = ld_open,
	.read = ld_read,
	.write = ld_write,
	.flush = ld_flush,
	.fsync = ld_fsync,
	.opendir = ld_opendir,
	.readdir = ld_readdir,
};

static long long parse_size(const char *text)
{
	char *end;
	long long value;

	errno = 0;
	value = strtoll(text, &end, 10);
	if (errno || value <= 0 || end == text)
		return -1;
	switch (*end) {
	case 'k': case 'K': value <<= 10; end++; break;
	case 'm': case 'M': value <<= 20; end++; break;
	case 'g': case 'G': value <<= 30; end++; break;
	case 't': case 'T': value <<= 40; end++; break;
	}
	return *end ? -1 : value;
}

static void usage(FILE *out)
{
	fprintf(out, "usage: latencydev --size BYTES[KMGT] --latency-us N [--threads N] [--prefault] [--page-cache] MOUNTPOINT\n"
		"Serves one RAM file, MOUNTPOINT/" FILE_NAME ", answering every read and write\n"
		"after N microseconds.  Unmount (or SIGTERM) to stop it; SIGUSR1 prints what\n"
		"it served since the last SIGUSR1 (reads, writes, bytes, most requests in flight).\n");
}

int main(int argc, char *argv[])
{
	static const struct option options[] = {
		{ "size", required_argument, NULL, 's' },
		{ "latency-us", required_argument, NULL, 'l' },
		{ "threads", required_argument, NULL, 't' },
		{ "prefault", no_argument, NULL, 'p' },
		{ "page-cache", no_argument, NULL, 'c' },
		{ "help", no_argument, NULL, 'h' },
		{ NULL, 0, NULL, 0 },
	};
	char *fuse_argv[] = { argv[0], "-o", "max_read=1048576,fsname=latencydev,subtype=latencydev", NULL };
	struct fuse_args args = FUSE_ARGS_INIT(3, fuse_argv);
	struct fuse_loop_config *config;
	struct fuse_session *se;
	static sigset_t usr1;
	pthread_t stats;
	const char *mountpoint;
	long long size = -1, latency_us = -1, threads = 256;
	int opt, ret = 1, prefault = 0;

	while ((opt = getopt_long(argc, argv, "s:l:t:pch", options, NULL)) != -1) {
		switch (opt) {
		case 's': size = parse_size(optarg); break;
		case 'l': latency_us = strtoll(optarg, NULL, 10); break;
		case 't': threads = strtoll(optarg, NULL, 10); break;
		case 'p': prefault = 1; break;
		case 'c': page_cache = 1; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	if (optind != argc - 1 || size <= 0 || size % 4096 || latency_us < 0 || threads < 1) {
		fprintf(stderr, "latencydev: need a positive --size (a multiple of 4096), "
			"--latency-us >= 0, --threads >= 1 and one MOUNTPOINT\n");
		usage(stderr);
		return 2;
	}
	mountpoint = argv[optind];
	dev_size = size;
	latency_ns = latency_us * 1000LL;
	clock_gettime(CLOCK_REALTIME, &start_time);

	/* Pages are allocated as they are first written; unwritten ones read as 0. */
	ram = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (ram == MAP_FAILED) {
		perror("latencydev: mmap");
		return 1;
	}
	madvise(ram, size, MADV_HUGEPAGE);   /* fewer page faults; fine if refused */
	if (prefault)
		memset(ram, 0, size);        /* fault every page in now, not on first write */

	/* SIGUSR1 goes to the stats thread only: blocked here, before any thread starts. */
	sigemptyset(&usr1);
	sigaddset(&usr1, SIGUSR1);
	if (pthread_sigmask(SIG_BLOCK, &usr1, NULL) != 0 ||
	    pthread_create(&stats, NULL, stats_thread, &usr1) != 0) {
		fprintf(stderr, "latencydev: cannot start the stats thread\n");
		goto out_free;
	}
	pthread_detach(stats);

	se = fuse_session_new(&args, &ops, sizeof(ops), NULL);
	if (se == NULL)
		goto out_free;
	if (fuse_set_signal_handlers(se) != 0)
		goto out_session;
	if (fuse_session_mount(se, mountpoint) != 0)
		goto out_signals;
	printf("mounted\n");
	fflush(stdout);

	config = fuse_loop_cfg_create();
	if (config == NULL)
		goto out_unmount;
	fuse_loop_cfg_set_clone_fd(config, 1);
	fuse_loop_cfg_set_max_threads(config, threads);
	/* Keep every thread once started: no creation per burst of requests. */
	fuse_loop_cfg_set_idle_threads(config, threads);
	ret = fuse_session_loop_mt(se, config);
	fuse_loop_cfg_destroy(config);
	/* 0: unmounted by someone else; > 0: the signal that stopped us. */
	ret = ret < 0 ? 1 : 0;
out_unmount:
	fuse_session_unmount(se);
out_signals:
	fuse_remove_signal_handlers(se);
out_session:
	fuse_session_destroy(se);
out_free:
	fuse_opt_free_args(&args);
	munmap(ram, size);
	return ret;
}
