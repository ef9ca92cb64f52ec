#![no_main]

libfuzzer_sys::fuzz_target!(|bytes: &[u8]| {
    let _ = gguf_format::parse(bytes);
});
