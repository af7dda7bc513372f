//! Shape rules of recurrent layers (LSTM, GRU, RNN): the sequence output
//! and the final states.

use super::{Node, attr_i, attr_s, mk};
use crate::plan::graph::Info;

pub(super) fn rnn(c: &Node, r: &mut [Option<Info>]) -> Option<Info> {
    let n = c.n;
    match c.shape(0) {
        Some(x) if x.len() == 3 => {
            let h = attr_i(n, "hidden_size").unwrap_or(0).max(0) as u64;
            let dirs = if attr_s(n, "direction").as_deref() == Some("bidirectional") {
                2
            } else {
                1
            };
            let batch_first = attr_i(n, "layout").unwrap_or(0) != 0;
            let (seq, batch) = if batch_first {
                (x[1], x[0])
            } else {
                (x[0], x[1])
            };
            let y = if batch_first {
                vec![batch, seq, dirs, h]
            } else {
                vec![seq, dirs, batch, h]
            };
            let state = if batch_first {
                vec![batch, dirs, h]
            } else {
                vec![dirs, batch, h]
            };
            for slot in r.iter_mut().skip(1) {
                *slot = Some(mk(state.clone(), c.dtype(0), None));
            }
            Some(mk(y, c.dtype(0), None))
        }
        _ => None,
    }
}
