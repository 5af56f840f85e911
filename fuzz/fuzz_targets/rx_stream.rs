//! A hostile peer's byte stream, read in chunks of fuzzer-chosen sizes through the receive
//! half, with chain offers taken and coded frames decoded as the kernel-TCP sink does: it
//! never panics, never delivers more payload than arrived, once it reports an error the
//! connection is over, and bytes `RxState::data_ahead` calls a data frame give the next read
//! payload. Half the seeds also read as a side whose own stream is sealed (acknowledgements
//! count only with a tag).
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::connection::chain::Chain;
use substrate::reliability::RxState;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    // First byte picks read sizes; the rest is the link.
    let seed = data[0] as usize;
    let link = &data[1..];
    // An odd first byte: the peer's stream is already sealed (`aead`, chain 1, a fixed key),
    // so what a sealed stream refuses is reached too.
    let rx = if seed & 1 == 1 {
        let ids = Chain::build("aead").and_then(|c| c.ids()).expect("aead is built in");
        RxState::sealed_by(1, ids, [7; 32]).expect("a keyed chain")
    } else {
        RxState::new()
    };
    // Bit 1: our stream is sealed as well, so acknowledgements count only with their tag.
    let rx0 = if seed & 2 == 2 { rx.with_tagged_acks(0x7a6, seed & 4 == 4) } else { rx };
    let mut rx = rx0;
    let mut pos = 0;
    let mut delivered = 0usize;
    let mut i = 0usize;
    while pos < link.len() {
        i += 1;
        let n = 1 + (seed * 31 + i * 17) % 97;
        if rx.coded_len > 0 {
            // The sink: the whole coded payload, decoded with the chain it names.
            let len = rx.coded_len as usize;
            if link.len() - pos < len {
                return;
            }
            let ids = rx.chain_ids(rx.coded_chain).expect("a coded frame names a taken chain");
            let mut chain = Chain::from_ids(ids).expect("a taken chain can be built");
            chain.set_key(rx.chain_key(rx.coded_chain));
            let Ok(dec) = chain_decode(chain, rx.coded_seq, &link[pos..pos + len]) else { return };
            let at = rx.coded_taken as usize;
            if dec.is_empty() || at > dec.len() {
                return;
            }
            let k = n.min(dec.len() - at);
            rx.coded_delivered(k);
            delivered += k;
            if at + k == dec.len() {
                pos += len;
                rx.coded_done();
            }
            continue;
        }
        // The quick path of a small receive (`RxState::take_plain_frame`), on the bytes such
        // a read could get: it takes what the general parse takes, or declines and changes
        // nothing.
        let chunk = &link[pos..(pos + n + 24).min(link.len())];
        let mut quick = rx;
        match quick.take_plain_frame(chunk) {
            Some(k) => {
                let mut general = rx;
                let mut copy = chunk.to_vec();
                let i = general.parse_buffer(&mut copy).expect("what the quick path takes parses");
                assert_eq!(i.payload, k);
                assert_eq!(&copy[..k], &chunk[24..]);
                let key = |r: &RxState| {
                    (
                        r.delivered,
                        r.peer_ack,
                        r.frame_rem,
                        r.header_len,
                        r.fin,
                        r.ctl_rem,
                        r.coded_len,
                        r.careful,
                    )
                };
                assert_eq!(key(&quick), key(&general));
            }
            None => assert_eq!(quick.to_bytes(), rx.to_bytes(), "declined, yet changed"),
        }
        // What the readiness check relies on: bytes it calls a data frame ahead give the
        // program's next read payload (or end the connection), whatever the read's size.
        let ahead = rx.data_ahead(&link[pos..]);
        let mut app = vec![0u8; n];
        let plan = rx.plan_read(n);
        let (got, r) = rx.read_from(plan, &link[pos..], &mut app);
        pos += got;
        match r {
            Ok(r) => {
                assert!(r.payload <= got);
                assert!(!ahead || r.payload > 0, "a data frame ahead, and a read that gave nothing");
                delivered += r.payload;
            }
            Err(_) => return,
        }
        let _ = rx.take_answer_owed();
    }
    assert!(delivered <= link.len());
    assert_eq!(rx.delivered as usize, delivered);
});

fn chain_decode(mut c: Chain, seq: u64, input: &[u8]) -> Result<Vec<u8>, ()> {
    c.decode(seq, input.to_vec()).map_err(|_| ())
}
