//! A node's default chains as the agent passes them to the layers (or as a configuration
//! file gives them): parsing never panics; what parses writes back to text that parses to
//! the same rules, and a lookup of any address answers.
#![no_main]
use libfuzzer_sys::fuzz_target;
use substrate::connection::chain::Policy;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(p) = Policy::parse([text]) {
        let again = Policy::parse([p.to_text().as_str()]).expect("its own text");
        assert_eq!(again, p);
        for ip in ["10.0.0.1", "::1", "fd00::7", "192.168.1.200", "::ffff:10.0.0.1"] {
            let _ = p.chain_for(ip.parse().unwrap());
        }
    }
});
