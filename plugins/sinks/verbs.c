/*
 * libvmi_sink_verbs.so: RDMA links for vmi (plugins/vmi_sink.h).
 *
 * A link is a reliable connected endpoint (an RC queue pair on verbs hardware) set up through
 * libfabric's connection manager, moving the layer's bytes in messages of registered buffers:
 *
 *   - each side posts RECVS receive buffers of BUF bytes; a message is a 4-byte header (the
 *     receive buffers the sender has posted again since its last message: credits for the
 *     peer) and up to BUF - 4 bytes of the stream;
 *   - a side sends only into buffers the peer has posted (its credits), keeping the last one
 *     for a message that only returns credits, sent once half the peer's buffers wait for
 *     theirs; so no message ever waits for a receive buffer (no receiver-not-ready retries)
 *     and neither side can be left without credits;
 *   - a receive buffer goes back to the device once the layer has read all of it.
 *
 * The devices come from libfabric's `verbs` provider (VMI_VERBS_PROVIDER names another, e.g.
 * `tcp`, to run the same code on a machine without RDMA hardware); `probe` asks libibverbs
 * first, so a node without RDMA says so plainly.
 *
 * Build: gcc -shared -fPIC -O2 -I plugins -o libvmi_sink_verbs.so plugins/sinks/verbs.c \
 *            -lfabric -libverbs
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <netinet/in.h>

#include <infiniband/verbs.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include "vmi_sink.h"

#define FIVER FI_VERSION(1, 9)
#define BUF (32 * 1024)
#define RECVS 32
#define SENDS 32
#define HDR 4

static void say(char *why, size_t cap, const char *fmt, ...)
{
    if (!why || !cap)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
}

static const char *provider(void)
{
    const char *p = getenv("VMI_VERBS_PROVIDER");
    return p && *p ? p : "verbs";
}

static struct fi_info *base_hints(void)
{
    struct fi_info *h = fi_allocinfo();
    if (!h)
        return NULL;
    h->ep_attr->type = FI_EP_MSG;
    h->caps = FI_MSG;
    h->mode = FI_CONTEXT;
    h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    h->fabric_attr->prov_name = strdup(provider());
    return h;
}

/* ---------------------------------------------------------------------------------------- */
/* Probe */

static int probe(char *why, size_t cap)
{
    if (strcmp(provider(), "verbs") == 0) {
        int n = 0;
        errno = 0;
        struct ibv_device **list = ibv_get_device_list(&n);
        if (!list) {
            int e = errno;
            say(why, cap, "no RDMA device: ibv_get_device_list failed (%s%s)", strerror(e),
                e == ENOSYS ? ": the kernel has no RDMA support" : "");
            return 0;
        }
        ibv_free_device_list(list);
        if (n == 0) {
            say(why, cap, "no RDMA device: libibverbs lists none");
            return 0;
        }
    }
    struct fi_info *hints = base_hints(), *info = NULL;
    if (!hints) {
        say(why, cap, "out of memory");
        return -1;
    }
    int r = fi_getinfo(FIVER, NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (r == -FI_ENODATA) {
        say(why, cap, "no device: libfabric's %s provider offers no reliable endpoint", provider());
        return 0;
    }
    if (r) {
        say(why, cap, "libfabric's %s provider: %s", provider(), fi_strerror(-r));
        return -1;
    }
    int n = 0;
    const char *last = NULL;
    for (struct fi_info *i = info; i; i = i->next) {
        const char *d = i->domain_attr->name;
        if (!last || strcmp(last, d) != 0)
            n++;
        last = d;
    }
    fi_freeinfo(info);
    say(why, cap, "%d devices through libfabric's %s provider", n, provider());
    return n;
}

/* ---------------------------------------------------------------------------------------- */
/* Links */

struct slot {
    struct fi_context ctx; /* first: completions give back its address */
    int idx;
    int recv;
};

struct link {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_domain *domain;
    struct fid_eq *eq;
    struct fid_cq *cq;
    struct fid_ep *ep;
    struct fid_mr *mr;
    void *desc;
    int epfd; /* readable when the completion queue or the event queue is */
    uint8_t *mem; /* RECVS receive buffers, then SENDS send buffers */
    struct slot slots[RECVS + SENDS];
    /* Receive: completed buffers in order, their lengths, what of the head was read. */
    int done[RECVS];
    uint32_t done_len[RECVS];
    int done_head, done_n;
    uint32_t head_read;
    /* Send: free buffers, credits (peer buffers we may fill), owed (ours posted again). */
    int free_send[SENDS];
    int free_n;
    uint32_t credits, owed;
    int failed;
    int connected;
};

static uint8_t *buf_of(struct link *l, int idx) { return l->mem + (size_t)idx * BUF; }

static void link_free(struct link *l)
{
    if (!l)
        return;
    if (l->ep)
        fi_close(&l->ep->fid);
    if (l->cq)
        fi_close(&l->cq->fid);
    if (l->mr)
        fi_close(&l->mr->fid);
    if (l->eq)
        fi_close(&l->eq->fid);
    if (l->domain)
        fi_close(&l->domain->fid);
    if (l->fabric)
        fi_close(&l->fabric->fid);
    if (l->epfd >= 0)
        close(l->epfd);
    if (l->info)
        fi_freeinfo(l->info);
    free(l->mem);
    free(l);
}

static int post_recv(struct link *l, int idx)
{
    struct slot *s = &l->slots[idx];
    s->idx = idx;
    s->recv = 1;
    for (;;) {
        ssize_t r = fi_recv(l->ep, buf_of(l, idx), BUF, l->desc, 0, &s->ctx);
        if (r == 0)
            return 0;
        if (r != -FI_EAGAIN)
            return (int)r;
        struct fi_cq_msg_entry e;
        fi_cq_read(l->cq, &e, 0); /* progress */
    }
}

/* The resources of a link on `info` (domain, queues, registered buffers, endpoint), with
 * every receive buffer posted; not connected yet. */
static struct link *link_new(struct fi_info *info, char *why, size_t cap)
{
    struct link *l = calloc(1, sizeof *l);
    if (!l) {
        say(why, cap, "out of memory");
        return NULL;
    }
    l->epfd = -1;
    l->info = fi_dupinfo(info);
    l->mem = aligned_alloc(4096, (size_t)(RECVS + SENDS) * BUF);
    if (!l->info || !l->mem) {
        say(why, cap, "out of memory");
        goto fail;
    }
    int r;
    const char *step;
    struct fi_eq_attr eqa = {.size = 16, .wait_obj = FI_WAIT_FD};
    struct fi_cq_attr cqa = {.size = 2 * (RECVS + SENDS), .format = FI_CQ_FORMAT_MSG,
                             .wait_obj = FI_WAIT_FD};
    if ((r = fi_fabric(l->info->fabric_attr, &l->fabric, NULL))) { step = "fi_fabric"; goto err; }
    if ((r = fi_domain(l->fabric, l->info, &l->domain, NULL))) { step = "fi_domain"; goto err; }
    if ((r = fi_eq_open(l->fabric, &eqa, &l->eq, NULL))) { step = "fi_eq_open"; goto err; }
    if ((r = fi_cq_open(l->domain, &cqa, &l->cq, NULL))) { step = "fi_cq_open"; goto err; }
    if ((r = fi_mr_reg(l->domain, l->mem, (size_t)(RECVS + SENDS) * BUF, FI_SEND | FI_RECV, 0, 0, 0,
                       &l->mr, NULL))) {
        if (l->info->domain_attr->mr_mode & FI_MR_LOCAL) { step = "fi_mr_reg"; goto err; }
        l->mr = NULL; /* the provider needs no registration */
    }
    l->desc = l->mr ? fi_mr_desc(l->mr) : NULL;
    if ((r = fi_endpoint(l->domain, l->info, &l->ep, NULL))) { step = "fi_endpoint"; goto err; }
    if ((r = fi_ep_bind(l->ep, &l->eq->fid, 0))) { step = "fi_ep_bind(eq)"; goto err; }
    if ((r = fi_ep_bind(l->ep, &l->cq->fid, FI_TRANSMIT | FI_RECV))) { step = "fi_ep_bind(cq)"; goto err; }
    if ((r = fi_enable(l->ep))) { step = "fi_enable"; goto err; }
    for (int i = 0; i < RECVS; i++)
        if ((r = post_recv(l, i))) { step = "fi_recv"; goto err; }
    for (int i = 0; i < SENDS; i++)
        l->free_send[l->free_n++] = RECVS + i;
    l->credits = RECVS; /* the peer posts as many as we do */
    int cqfd = -1, eqfd = -1;
    if ((r = fi_control(&l->cq->fid, FI_GETWAIT, &cqfd))) { step = "FI_GETWAIT(cq)"; goto err; }
    if ((r = fi_control(&l->eq->fid, FI_GETWAIT, &eqfd))) { step = "FI_GETWAIT(eq)"; goto err; }
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev = {.events = EPOLLIN};
    if (l->epfd < 0 || epoll_ctl(l->epfd, EPOLL_CTL_ADD, cqfd, &ev) ||
        epoll_ctl(l->epfd, EPOLL_CTL_ADD, eqfd, &ev)) {
        say(why, cap, "epoll: %s", strerror(errno));
        goto fail;
    }
    return l;
err:
    say(why, cap, "%s: %s", step, fi_strerror(-r));
fail:
    link_free(l);
    return NULL;
}

/* Waits for the connection's FI_CONNECTED (or its refusal) on the link's event queue. */
static int wait_connected(struct link *l, int timeout_ms, char *why, size_t cap)
{
    uint32_t event;
    struct fi_eq_cm_entry entry;
    ssize_t r = fi_eq_sread(l->eq, &event, &entry, sizeof entry, timeout_ms, 0);
    if (r == -FI_EAVAIL) {
        struct fi_eq_err_entry err = {0};
        fi_eq_readerr(l->eq, &err, 0);
        say(why, cap, "connection refused or failed: %s", fi_strerror(err.err));
        return -1;
    }
    if (r == -FI_EAGAIN || r == -FI_ETIMEDOUT) {
        say(why, cap, "not connected within %d ms", timeout_ms);
        return -1;
    }
    if (r < 0) {
        say(why, cap, "fi_eq_sread: %s", fi_strerror((int)-r));
        return -1;
    }
    if (event != FI_CONNECTED) {
        say(why, cap, "unexpected connection event %u", event);
        return -1;
    }
    l->connected = 1;
    return 0;
}

struct listener {
    struct fi_info *info;
    struct fid_fabric *fabric;
    struct fid_eq *eq;
    struct fid_pep *pep;
};

static void close_listener(void *p)
{
    struct listener *ls = p;
    if (!ls)
        return;
    if (ls->pep)
        fi_close(&ls->pep->fid);
    if (ls->eq)
        fi_close(&ls->eq->fid);
    if (ls->fabric)
        fi_close(&ls->fabric->fid);
    if (ls->info)
        fi_freeinfo(ls->info);
    free(ls);
}

static void *listen_at(const char *ip, uint8_t *addr, size_t *addr_len, char *why, size_t cap)
{
    struct listener *ls = calloc(1, sizeof *ls);
    struct fi_info *hints = base_hints();
    if (!ls || !hints) {
        say(why, cap, "out of memory");
        free(ls);
        fi_freeinfo(hints);
        return NULL;
    }
    int r;
    const char *step;
    if ((r = fi_getinfo(FIVER, ip, "0", FI_SOURCE, hints, &ls->info))) { step = "fi_getinfo"; goto err; }
    struct fi_eq_attr eqa = {.size = 16, .wait_obj = FI_WAIT_UNSPEC};
    if ((r = fi_fabric(ls->info->fabric_attr, &ls->fabric, NULL))) { step = "fi_fabric"; goto err; }
    if ((r = fi_eq_open(ls->fabric, &eqa, &ls->eq, NULL))) { step = "fi_eq_open"; goto err; }
    if ((r = fi_passive_ep(ls->fabric, ls->info, &ls->pep, NULL))) { step = "fi_passive_ep"; goto err; }
    if ((r = fi_pep_bind(ls->pep, &ls->eq->fid, 0))) { step = "fi_pep_bind"; goto err; }
    if ((r = fi_listen(ls->pep))) { step = "fi_listen"; goto err; }
    size_t len = VMI_SINK_ADDR_MAX;
    if ((r = fi_getname(&ls->pep->fid, addr, &len))) { step = "fi_getname"; goto err; }
    *addr_len = len;
    fi_freeinfo(hints);
    return ls;
err:
    say(why, cap, "listening at %s through libfabric's %s provider: %s: %s", ip, provider(), step,
        fi_strerror(-r));
    fi_freeinfo(hints);
    close_listener(ls);
    return NULL;
}

static void *accept_link(void *p, int timeout_ms, char *why, size_t cap)
{
    struct listener *ls = p;
    uint32_t event;
    struct fi_eq_cm_entry entry;
    ssize_t r = fi_eq_sread(ls->eq, &event, &entry, sizeof entry, timeout_ms, 0);
    if (r == -FI_EAGAIN || r == -FI_ETIMEDOUT) {
        say(why, cap, "no connection within %d ms", timeout_ms);
        return NULL;
    }
    if (r == -FI_EAVAIL) {
        struct fi_eq_err_entry err = {0};
        fi_eq_readerr(ls->eq, &err, 0);
        say(why, cap, "listener: %s", fi_strerror(err.err));
        return NULL;
    }
    if (r < 0 || event != FI_CONNREQ) {
        say(why, cap, "listener: unexpected event (%zd, %u)", r, event);
        if (r >= 0 && entry.info)
            fi_freeinfo(entry.info);
        return NULL;
    }
    struct link *l = link_new(entry.info, why, cap);
    if (!l) {
        fi_reject(ls->pep, entry.info->handle, NULL, 0);
        fi_freeinfo(entry.info);
        return NULL;
    }
    fi_freeinfo(entry.info);
    int e = fi_accept(l->ep, NULL, 0);
    if (e) {
        say(why, cap, "fi_accept: %s", fi_strerror(-e));
        link_free(l);
        return NULL;
    }
    if (wait_connected(l, timeout_ms, why, cap)) {
        link_free(l);
        return NULL;
    }
    return l;
}

static void *connect_to(const uint8_t *addr, size_t addr_len, int timeout_ms, char *why, size_t cap)
{
    if (addr_len < sizeof(sa_family_t) || addr_len > VMI_SINK_ADDR_MAX) {
        say(why, cap, "an endpoint address of %zu bytes", addr_len);
        return NULL;
    }
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, addr, addr_len < sizeof ss ? addr_len : sizeof ss);
    uint32_t format;
    if (ss.ss_family == AF_INET && addr_len == sizeof(struct sockaddr_in))
        format = FI_SOCKADDR_IN;
    else if (ss.ss_family == AF_INET6 && addr_len == sizeof(struct sockaddr_in6))
        format = FI_SOCKADDR_IN6;
    else {
        say(why, cap, "not an IP endpoint address (family %u, %zu bytes)", ss.ss_family, addr_len);
        return NULL;
    }
    struct fi_info *hints = base_hints(), *info = NULL;
    if (!hints) {
        say(why, cap, "out of memory");
        return NULL;
    }
    hints->addr_format = format;
    hints->dest_addr = malloc(addr_len);
    if (!hints->dest_addr) {
        fi_freeinfo(hints);
        say(why, cap, "out of memory");
        return NULL;
    }
    memcpy(hints->dest_addr, &ss, addr_len);
    hints->dest_addrlen = addr_len;
    int r = fi_getinfo(FIVER, NULL, NULL, 0, hints, &info);
    fi_freeinfo(hints);
    if (r) {
        say(why, cap, "no route through libfabric's %s provider: %s", provider(), fi_strerror(-r));
        return NULL;
    }
    struct link *l = link_new(info, why, cap);
    if (!l) {
        fi_freeinfo(info);
        return NULL;
    }
    r = fi_connect(l->ep, info->dest_addr, NULL, 0);
    fi_freeinfo(info);
    if (r) {
        say(why, cap, "fi_connect: %s", fi_strerror(-r));
        link_free(l);
        return NULL;
    }
    if (wait_connected(l, timeout_ms, why, cap)) {
        link_free(l);
        return NULL;
    }
    return l;
}

/* Takes what the completion queue and the event queue hold; -1 once the link failed. The
 * event queue is read first: messages that came before the peer's shutdown are then in the
 * completion queue when it is read, and are read before the link counts as closed. */
static int progress(struct link *l)
{
    if (l->failed)
        return -1;
    if (l->connected) {
        uint32_t event;
        struct fi_eq_cm_entry entry;
        ssize_t r = fi_eq_read(l->eq, &event, &entry, sizeof entry, 0);
        if (r == -FI_EAVAIL || (r >= 0 && event == FI_SHUTDOWN)) {
            l->connected = 0;
            if (r == -FI_EAVAIL) {
                struct fi_eq_err_entry err = {0};
                fi_eq_readerr(l->eq, &err, 0);
            }
        }
    }
    struct fi_cq_msg_entry e[16];
    for (;;) {
        ssize_t n = fi_cq_read(l->cq, e, 16);
        if (n == -FI_EAGAIN)
            break;
        if (n < 0) {
            struct fi_cq_err_entry err = {0};
            fi_cq_readerr(l->cq, &err, 0);
            l->failed = 1;
            return -1;
        }
        for (ssize_t i = 0; i < n; i++) {
            struct slot *s = (struct slot *)e[i].op_context;
            if (!s->recv) {
                l->free_send[l->free_n++] = s->idx;
                continue;
            }
            if (e[i].len < HDR || e[i].len > BUF) {
                l->failed = 1; /* not a message of this sink */
                return -1;
            }
            uint32_t credits;
            memcpy(&credits, buf_of(l, s->idx), HDR);
            if (credits > RECVS || l->credits + credits > RECVS) {
                l->failed = 1;
                return -1;
            }
            l->credits += credits;
            if (e[i].len == HDR) {
                /* Only credits: the buffer goes back at once. */
                if (post_recv(l, s->idx)) {
                    l->failed = 1;
                    return -1;
                }
                l->owed++;
                continue;
            }
            int at = (l->done_head + l->done_n) % RECVS;
            l->done[at] = s->idx;
            l->done_len[at] = (uint32_t)e[i].len;
            l->done_n++;
        }
    }
    /* (Once the peer shut the link down, what it sent before is still read first.) */
    return l->failed ? -1 : 0;
}

static int post_send(struct link *l, const uint8_t *data, size_t n)
{
    int idx = l->free_send[--l->free_n];
    uint8_t *b = buf_of(l, idx);
    memcpy(b, &l->owed, HDR);
    if (n)
        memcpy(b + HDR, data, n);
    struct slot *s = &l->slots[idx];
    s->idx = idx;
    s->recv = 0;
    ssize_t r;
    while ((r = fi_send(l->ep, b, HDR + n, l->desc, 0, &s->ctx)) == -FI_EAGAIN) {
        if (progress(l) < 0)
            break;
    }
    if (r) {
        l->free_send[l->free_n++] = idx;
        l->failed = 1;
        return -1;
    }
    l->owed = 0;
    l->credits--;
    return 0;
}

/* Gives the peer back its credits once half its buffers wait for them. */
static void return_credits(struct link *l)
{
    if (l->owed >= RECVS / 2 && l->credits >= 1 && l->free_n > 0 && !l->failed)
        post_send(l, NULL, 0);
}

static long send_bytes(void *p, const uint8_t *buf, size_t n)
{
    struct link *l = p;
    if (progress(l) < 0 || !l->connected)
        return -1;
    size_t took = 0;
    /* The last credit stays for a message that only returns credits. */
    while (took < n && l->credits >= 2 && l->free_n > 0) {
        size_t k = n - took < BUF - HDR ? n - took : BUF - HDR;
        if (post_send(l, buf + took, k))
            return took ? (long)took : -1;
        took += k;
    }
    return_credits(l);
    return (long)took;
}

static long recv_bytes(void *p, uint8_t *buf, size_t cap)
{
    struct link *l = p;
    int st = progress(l);
    size_t got = 0;
    while (got < cap && l->done_n > 0) {
        int idx = l->done[l->done_head];
        uint32_t len = l->done_len[l->done_head] - HDR;
        uint32_t k = len - l->head_read;
        if (k > cap - got)
            k = (uint32_t)(cap - got);
        memcpy(buf + got, buf_of(l, idx) + HDR + l->head_read, k);
        got += k;
        l->head_read += k;
        if (l->head_read == len) {
            l->done_head = (l->done_head + 1) % RECVS;
            l->done_n--;
            l->head_read = 0;
            if (l->connected && post_recv(l, idx) == 0)
                l->owed++;
        }
    }
    if (l->connected)
        return_credits(l);
    if (got)
        return (long)got;
    if (st < 0 || !l->connected)
        return -1;
    return 0;
}

static int arm(void *p)
{
    struct link *l = p;
    uint32_t credits = l->credits, owed = l->owed;
    int free_n = l->free_n, done_n = l->done_n;
    if (progress(l) < 0 || !l->connected)
        return -1; /* recv/send now say so */
    if (l->done_n != done_n || l->credits != credits || l->free_n != free_n || l->owed != owed ||
        l->done_n > 0)
        return -1;
    struct fid *fids[2] = {&l->cq->fid, &l->eq->fid};
    if (fi_trywait(l->fabric, fids, 2) != FI_SUCCESS)
        return -1;
    return l->epfd;
}

static void close_link(void *p)
{
    struct link *l = p;
    if (!l)
        return;
    if (l->connected)
        fi_shutdown(l->ep, 0);
    link_free(l);
}

static const struct vmi_sink table = {
    .abi = VMI_SINK_ABI,
    .name = "verbs",
    .probe = probe,
    .listen = listen_at,
    .accept = accept_link,
    .close_listener = close_listener,
    .connect = connect_to,
    .send = send_bytes,
    .recv = recv_bytes,
    .arm = arm,
    .close = close_link,
};

const struct vmi_sink *vmi_sink_entry(void) { return &table; }
