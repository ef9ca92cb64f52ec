//! The order tensors go to the device in, grouped by layer.

use std::collections::HashSet;
use std::ops::Range;

use crate::TensorHandle;

/// Tensors in upload order, in groups: one per transformer block (`blk.N.*`), one for
/// what comes before the first block (`input`: embeddings) and one for what comes after
/// the last (`output`). A group is the unit compute waits for: layer `N` can run once
/// its group is resident.
#[derive(Clone, Debug, Default)]
pub struct UploadOrder {
    tensors: Vec<TensorHandle>,
    groups: Vec<UploadGroup>,
}

/// A named run of tensors in an [`UploadOrder`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UploadGroup {
    /// `input`, `blk.N` or `output`.
    pub name: String,
    /// Positions of its tensors in [`UploadOrder::tensors`].
    pub tensors: Range<usize>,
}

/// The group a tensor name belongs to, given whether a block was seen before it.
fn group_key(name: &str, seen_block: bool) -> String {
    if let Some(rest) = name.strip_prefix("blk.") {
        if let Some((layer, _)) = rest.split_once('.') {
            if !layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()) {
                return format!("blk.{layer}");
            }
        }
    }
    if seen_block { "output" } else { "input" }.to_owned()
}

impl UploadOrder {
    /// An order that uploads nothing in the background (every tensor loads on first
    /// use).
    pub fn empty() -> UploadOrder {
        UploadOrder::default()
    }

    /// `handles` in the order given (an execution plan's first-use order), duplicates
    /// dropped, gathered into groups by layer. Tensors of one group keep their relative
    /// order; groups come in the order of their first tensor.
    pub fn by_layer<'a>(handles: impl IntoIterator<Item = &'a TensorHandle>) -> UploadOrder {
        let mut seen = HashSet::new();
        let mut seen_block = false;
        let mut keyed: Vec<(String, Vec<TensorHandle>)> = Vec::new();
        for handle in handles {
            if !seen.insert(handle.index()) {
                continue;
            }
            let key = group_key(handle.name(), seen_block);
            seen_block |= key.starts_with("blk.");
            match keyed.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(handle.clone()),
                None => keyed.push((key, vec![handle.clone()])),
            }
        }
        let mut order = UploadOrder::default();
        for (name, members) in keyed {
            let start = order.tensors.len();
            order.tensors.extend(members);
            order.groups.push(UploadGroup {
                name,
                tensors: start..order.tensors.len(),
            });
        }
        order
    }

    /// Every tensor of the store in file order, grouped by layer.
    pub fn file_order(store: &crate::TensorStore) -> UploadOrder {
        let handles: Vec<TensorHandle> = store.tensors().collect();
        UploadOrder::by_layer(&handles)
    }

    /// The tensors, in upload order.
    pub fn tensors(&self) -> &[TensorHandle] {
        &self.tensors
    }

    pub fn groups(&self) -> &[UploadGroup] {
        &self.groups
    }

    /// The group holding block `layer` (`blk.{layer}`), if any.
    pub fn layer_group(&self, layer: usize) -> Option<usize> {
        let name = format!("blk.{layer}");
        self.groups.iter().position(|g| g.name == name)
    }

    /// Handles of the tensors of group `group`.
    pub fn group_tensors(&self, group: usize) -> &[TensorHandle] {
        self.groups
            .get(group)
            .map_or(&[][..], |g| &self.tensors[g.tensors.clone()])
    }

    /// Bytes of all tensors in the order.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorHandle::size).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::group_key;

    #[test]
    fn names_fall_into_input_blocks_and_output() {
        assert_eq!(group_key("token_embd.weight", false), "input");
        assert_eq!(group_key("blk.0.attn_q.weight", false), "blk.0");
        assert_eq!(group_key("blk.31.ffn_down.weight", true), "blk.31");
        assert_eq!(group_key("output_norm.weight", true), "output");
        assert_eq!(group_key("blk.x.weight", true), "output");
        assert_eq!(group_key("blk..weight", false), "input");
    }
}
