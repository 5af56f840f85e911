/*
 * An example device plug-in: every byte XORed with a byte that depends on its stream offset
 * (a stand-in for a cipher: the bytes on the wire differ from the program's, the lengths stay).
 *
 *   gcc -shared -fPIC -O2 -I.. -o libvmi_dev_xor.so xor.c
 *   cp libvmi_dev_xor.so /usr/lib/vmi/plugins/   # on every node
 *   vmictl device load xor --gid GID
 */
#include <stdlib.h>
#include <string.h>

#include "vmi_device.h"

struct state {
    unsigned long frames;
};

static uint8_t mask(uint64_t at)
{
    return (uint8_t)(0x5a ^ (at * 0x9e3779b97f4a7c15ull >> 56));
}

static size_t max_out(size_t n)
{
    return n;
}

static void *open_state(void)
{
    return calloc(1, sizeof(struct state));
}

static void close_state(void *s)
{
    free(s);
}

static long code(void *s, uint64_t seq, const uint8_t *in, size_t n, uint8_t *out, size_t cap)
{
    if (n > cap)
        return -1;
    for (size_t i = 0; i < n; i++)
        out[i] = in[i] ^ mask(seq + i);
    ((struct state *)s)->frames++;
    return (long)n;
}

static const struct vmi_device xor_device = {
    .abi = VMI_DEVICE_ABI,
    .name = "xor",
    .max_out = max_out,
    .open = open_state,
    .close = close_state,
    .encode = code,
    .decode = code,
};

const struct vmi_device *vmi_device_entry(void)
{
    return &xor_device;
}
