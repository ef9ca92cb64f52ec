//! The size of the server's KV pool: positions, or memory at the cache's types.

use anyhow::{bail, Result};

/// How large the KV pool is: positions, or memory at the cache's types.
#[derive(Clone, Copy, Debug)]
pub(super) enum PoolSize {
    Positions(usize),
    Mib(u64),
}

/// The KV pool's positions: `size` (default twice the context), at least one context
/// of `context_size` positions; a pool given in MiB that holds fewer, at
/// `bytes_per_position`, is an error rather than a larger pool.
pub(super) fn pool_positions(
    size: Option<PoolSize>,
    bytes_per_position: usize,
    context_size: usize,
) -> Result<usize> {
    Ok(match size {
        None => context_size.saturating_mul(2),
        Some(PoolSize::Positions(positions)) => positions.max(context_size),
        Some(PoolSize::Mib(mib)) => {
            let bytes = usize::try_from(mib.saturating_mul(1 << 20)).unwrap_or(usize::MAX);
            let positions = bytes / bytes_per_position.max(1);
            if positions < context_size {
                bail!(
                    "{mib} MiB hold {positions} positions, less than one context \
                     ({context_size})"
                );
            }
            positions
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_in_mib_holds_what_the_cache_types_fit() {
        // SmolLM2-135M's bytes a position: f16 23,040, q8_0 12,240, q4_0 6,480.
        let f16 = pool_positions(Some(PoolSize::Mib(64)), 23_040, 2048).expect("fits");
        let q8 = pool_positions(Some(PoolSize::Mib(64)), 12_240, 2048).expect("fits");
        let q4 = pool_positions(Some(PoolSize::Mib(64)), 6_480, 2048).expect("fits");
        assert_eq!(f16, (64 << 20) / 23_040);
        assert!(q8 * 100 >= f16 * 188, "{q8} against {f16}");
        assert!(q4 >= 3 * f16, "{q4} against {f16}");
        let small = pool_positions(Some(PoolSize::Mib(1)), 23_040, 2048).unwrap_err();
        assert!(
            small.to_string().contains("less than one context (2048)"),
            "{small}"
        );
        assert_eq!(pool_positions(None, 1, 100).expect("default"), 200);
        let positions = pool_positions(Some(PoolSize::Positions(10)), 1, 100);
        assert_eq!(positions.expect("positions"), 100);
    }
}
