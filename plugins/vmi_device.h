/*
 * vmi device plug-ins: filters of the device chain written outside the layer, in C or any
 * language that can export a C function, loaded into running programs from a plug-in folder.
 *
 * A plug-in is a shared library named libvmi_dev_NAME.so in the folder (VMI_PLUGINS, default
 * /usr/lib/vmi/plugins) that exports one function, vmi_device_entry, which returns the table
 * below. `vmictl device load NAME --gid GID` then puts the device on both directions of a
 * connection, as for the built-in devices: both layers must have the plug-in (a layer that
 * cannot load it refuses the chain, and the connection keeps the chain it had).
 *
 * A filter transforms one frame's payload at a time: encode on the sending side, decode on the
 * receiving side. It must be deterministic: the same bytes at the same stream offset always
 * encode to the same output (a frame sent again after a failover is encoded again), and
 * decode(encode(x)) == x. Decode gets the peer's bytes: it must check them and fail rather
 * than read or write out of bounds. The layer calls the functions of one state from one thread
 * at a time; different states may be used by different threads at once.
 */
#ifndef VMI_DEVICE_H
#define VMI_DEVICE_H

#include <stddef.h>
#include <stdint.h>

/* The interface version this header describes. */
#define VMI_DEVICE_ABI 1

struct vmi_device {
    /* VMI_DEVICE_ABI: a layer refuses a table of another version. */
    uint32_t abi;
    uint32_t reserved; /* 0 */
    /* The device's name (the NAME of its file). */
    const char *name;
    /* Most bytes n input bytes encode to (the layer sizes frames from it). */
    size_t (*max_out)(size_t n);
    /* A new state (one per direction of a connection and thread); NULL: it cannot work. */
    void *(*open)(void);
    /* Frees a state from open. */
    void (*close)(void *state);
    /* Encodes the n bytes at in (stream offset seq) into out (room for cap bytes, at least
     * max_out(n)). Returns the bytes written, or -1. */
    long (*encode)(void *state, uint64_t seq, const uint8_t *in, size_t n, uint8_t *out, size_t cap);
    /* Decodes what the peer's encode made. Returns the bytes written (at most cap), or -1
     * for bytes it did not make (the layer closes the connection). */
    long (*decode)(void *state, uint64_t seq, const uint8_t *in, size_t n, uint8_t *out, size_t cap);
};

/* The single entry point: the device's table, or NULL when the plug-in cannot initialise
 * (the layer refuses it with a log line). Called once per process. */
const struct vmi_device *vmi_device_entry(void);

#endif
