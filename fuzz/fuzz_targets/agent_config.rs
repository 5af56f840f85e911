//! The agent's configuration file (`/etc/vmi/agent.toml`, written by hand): any text parses
//! or is refused without a panic, a refusal names a line of the text, and settings that
//! pass print (`vmi-agent --check-config`) as a file that reads back as the same settings.
#![no_main]
use agent::config::{parse, resolve, File, Layer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    match parse(text) {
        Err(e) => {
            if let Some(l) = e.line {
                assert!(l >= 1 && l <= text.lines().count() + 1, "line {l} of {e}");
            }
        }
        Ok(layer) => {
            let file = File { path: None, text: text.to_string(), layer };
            if let Ok(s) = resolve(&Layer::default(), |_| None, &file) {
                let printed = s.to_toml();
                let again = parse(&printed).expect("printed settings parse");
                let file = File { path: None, text: printed, layer: again };
                assert_eq!(resolve(&Layer::default(), |_| None, &file).expect("and pass"), s);
            }
        }
    }
});
