//! The multipart reader as `POST /documents` drives it (boundary `X`, the whole body in one
//! chunk, every field read whole): any body ends in fields or an error, never a panic. With the
//! body all there, no step waits, so each future is polled once.
#![no_main]
use futures_util::FutureExt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let body = bytes::Bytes::copy_from_slice(data);
    let stream = futures_util::stream::once(async move { Ok::<_, std::convert::Infallible>(body) });
    let mut form = multer::Multipart::new(stream, "X");
    while let Some(Ok(Some(field))) = form.next_field().now_or_never() {
        let _ = field.name().map(str::to_string);
        let _ = field.file_name().map(str::to_string);
        let _ = field.content_type().map(|m| m.essence_str().to_string());
        if !matches!(field.bytes().now_or_never(), Some(Ok(_))) {
            break;
        }
    }
});
