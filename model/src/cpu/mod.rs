//! The CPU back end, beside [`crate::gpu`]: the transformer layer written once
//! ([`layer`]: its attention block and feed-forward block) over either KV layout, the
//! pass of one sequence over its [`crate::KvCache`] ([`pass`]), the products on the
//! weights' quantized blocks ([`products`]), and the first rows of those products handed
//! to another device while the CPU computes the rest ([`offload`], for a GPU model over
//! its budget). The scheduler's batches ([`crate::serve`]) assemble segments of the
//! paged pool and run the same layer.

mod layer;
mod moe;
mod offload;
mod pass;
mod products;
mod shift;

pub(crate) use layer::{layer, Context, Kv, Scratch, Segment};
pub(crate) use moe::{routed_part, MoeScratch, Pick};
pub(crate) use offload::RowOffload;
pub(crate) use pass::{
    embed, final_norm, forward, hidden_states, layers_on_host, on_the_pool, output_logits,
};
pub use pass::{Logits, PROGRESS_TARGET};
pub(crate) use shift::shift;
