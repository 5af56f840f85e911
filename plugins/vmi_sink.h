/*
 * vmi sink plug-ins: link devices written outside the layer (RDMA verbs first), loaded at run
 * time from the plug-in folder, so that the layer itself never links the libraries they need.
 *
 * A sink plug-in is a shared library named libvmi_sink_NAME.so in the folder (VMI_PLUGINS,
 * default /usr/lib/vmi/plugins) that exports one function, vmi_sink_entry, which returns the
 * table below. The layer refuses a table of another interface version, a missing entry point
 * or a failed initialisation with one log line, and uses its next substrate.
 *
 * What a sink gives the layer is a link: while it is up, a reliable, ordered stream of bytes
 * between two processes (the layer's connection core puts frames on it and keeps every frame
 * until the peer's layer acknowledges it, so a link that fails loses nothing: the core sends
 * its frames again on another link). A sink needs no message boundaries and no
 * acknowledgement of its own beyond what keeps its link reliable.
 *
 * Two layers set a link up with addresses they exchange themselves (over a link they already
 * have, or through their agents): one side opens a passive endpoint (`listen`), whose address
 * it sends to the other; the other `connect`s to it; the first `accept`s.
 *
 * Every function that can fail writes why into `why` (cap bytes, NUL-terminated). No function
 * may block longer than the time-out it is given; `send` and `recv` never block. The layer
 * calls the functions of one link from one thread at a time; different links may be used by
 * different threads at once.
 */
#ifndef VMI_SINK_H
#define VMI_SINK_H

#include <stddef.h>
#include <stdint.h>

/* The interface version this header describes. */
#define VMI_SINK_ABI 1

/* Largest endpoint address the layer carries between two nodes. */
#define VMI_SINK_ADDR_MAX 256

struct vmi_sink {
    /* VMI_SINK_ABI: a layer refuses a table of another version. */
    uint32_t abi;
    uint32_t reserved; /* 0 */
    /* The sink's name (the NAME of its file). */
    const char *name;
    /* How many devices of this sink the node has: > 0 usable, 0 none (why says so), < 0 the
     * sink cannot work here (why says why). Cheap enough to call once per process. */
    int (*probe)(char *why, size_t cap);
    /* A passive endpoint on the device that reaches local IPv4 or IPv6 address `ip` (text);
     * its address (at most VMI_SINK_ADDR_MAX bytes) goes to *addr and *addr_len. NULL when it
     * cannot be had. */
    void *(*listen)(const char *ip, uint8_t *addr, size_t *addr_len, char *why, size_t cap);
    /* The next link a peer connected to passive endpoint `ep`, waiting at most timeout_ms;
     * NULL when none came (or it failed). */
    void *(*accept)(void *ep, int timeout_ms, char *why, size_t cap);
    /* Frees a passive endpoint (links it accepted stay). */
    void (*close_listener)(void *ep);
    /* A link to the passive endpoint at `addr` (from the peer's listen), waiting at most
     * timeout_ms for it to be up; NULL when it cannot be had. */
    void *(*connect)(const uint8_t *addr, size_t addr_len, int timeout_ms, char *why, size_t cap);
    /* Takes up to n bytes for the peer: how many it took (0: no room now; wait on the link's
     * descriptor), or -1 when the link failed. */
    long (*send)(void *link, const uint8_t *buf, size_t n);
    /* Up to cap bytes from the peer: how many (0: none now), or -1 when the link failed or
     * the peer closed it. */
    long (*recv)(void *link, uint8_t *buf, size_t cap);
    /* Readies the link for a wait: a descriptor that becomes readable when send or recv may
     * make progress, or -1 when they may make progress now (call them again first). */
    int (*arm)(void *link);
    /* Closes a link (the peer's recv then fails). */
    void (*close)(void *link);
};

/* The single entry point: the sink's table, or NULL when the plug-in cannot initialise. */
const struct vmi_sink *vmi_sink_entry(void);

#endif
