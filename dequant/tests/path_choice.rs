//! The products' path as the program chooses it: [`set_avx512_allowed`] before the first
//! product keeps [`best_path`] off the AVX-512 kernels, and the choice then holds for the
//! process. A test binary of its own, since the choice is made once per process.

use dequant::matmul::{best_path, is_path_available, set_avx512_allowed, QuantizedMatrix};
use dequant::DecodePath;
use gguf_format::GgmlType;

#[test]
fn avx512_kept_off_before_the_first_product_stays_off() {
    set_avx512_allowed(false);
    let expected = if is_path_available(DecodePath::Avx2) {
        DecodePath::Avx2
    } else {
        DecodePath::Scalar
    };
    assert_eq!(best_path(), expected);

    // A product takes the same path, and allowing AVX-512 now changes nothing.
    let weights = vec![0u8; GgmlType::F32.row_bytes(32).unwrap() as usize];
    let matrix = QuantizedMatrix::new(GgmlType::F32, 1, 32, &weights).unwrap();
    let mut y = [1.0f32];
    matrix.matvec(&[1.0; 32], &mut y).unwrap();
    assert_eq!(y, [0.0]);
    set_avx512_allowed(true);
    assert_eq!(best_path(), expected);
}
