//! Copying into the replay ring without polluting the cache.
//!
//! Every byte a program sends is copied into its connection's replay ring, and read again
//! only after a failure. With several busy connections the rings are larger than the cache,
//! so an ordinary copy first reads each destination line from memory and then evicts what
//! the kernel and the program were using. Non-temporal stores write around the cache.

/// Copies `src` into `dst` (equal lengths); large copies use non-temporal stores.
#[inline]
pub fn to_ring(dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    if src.len() >= 4096 {
        stream_copy(dst, src);
        return;
    }
    dst.copy_from_slice(src);
}

// Not inlined: inlined into the ring commit, the loop came out at about twice the
// instructions per 64 bytes (callgrind on `vc_calls`).
#[cfg(target_arch = "x86_64")]
#[inline(never)]
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let n = dst.len().min(src.len());
    // Head: up to the first 16-byte aligned destination address.
    let head = ((16 - (dst.as_ptr() as usize & 15)) & 15).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let body = (n - head) & !63;
    let mut i = head;
    while i < head + body {
        // SAFETY: `i..i + 64` lies inside both slices (body is a multiple of 64 within n);
        // the destination is 16-byte aligned from `head` on; SSE2 is part of x86_64.
        unsafe {
            let s = src.as_ptr().add(i) as *const __m128i;
            let d = dst.as_mut_ptr().add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: orders the streaming stores before anything that follows (the ring is read
    // only by this connection's own code, after a resync, under the same lock).
    unsafe { _mm_sfence() };
    dst[i..n].copy_from_slice(&src[i..n]);
}

#[cfg(test)]
mod tests {
    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20000u32).map(|i| (i * 7 + 3) as u8).collect();
        for off in 0..17 {
            for len in [0, 1, 15, 63, 64, 65, 4095, 4096, 4097, 10000, 19000] {
                let mut dst = vec![0u8; 20000 + 32];
                super::to_ring(&mut dst[off..off + len], &src[..len]);
                assert_eq!(&dst[off..off + len], &src[..len], "off {off} len {len}");
                assert!(dst[..off].iter().all(|&b| b == 0));
                assert!(dst[off + len..].iter().all(|&b| b == 0));
            }
        }
    }
}
