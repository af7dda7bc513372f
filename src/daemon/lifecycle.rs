//! The daemon's one stop signal: a tree of cancellation tokens.
//!
//! ```text
//! process ─┬─ API, OTA agent, uplink      cancelled last, once the generation drained
//!          └─ generation ─┬─ sources      cancelled first (stop, reload)
//!                         └─ outputs      cancelled once the workers finished every frame
//! ```
//!
//! Cancelling a node cancels everything under it, so a daemon that returns
//! early (an error while starting) stops whatever it had started: the
//! process token is cancelled when the [`Lifecycle`] is dropped. Every part
//! that runs until the daemon stops gets a token from here; there is no
//! other stop signal.

use tokio_util::sync::{CancellationToken, DropGuard};

/// The root of the tree; dropping it stops everything.
pub(super) struct Lifecycle {
    process: CancellationToken,
    _stop_on_drop: DropGuard,
}

impl Lifecycle {
    pub(super) fn new() -> Lifecycle {
        let process = CancellationToken::new();
        Lifecycle {
            _stop_on_drop: process.clone().drop_guard(),
            process,
        }
    }

    /// For a part that lives as long as the process (API, OTA agent, uplink).
    pub(super) fn part(&self) -> CancellationToken {
        self.process.child_token()
    }

    /// The tokens of a new generation.
    pub(super) fn generation(&self) -> GenerationStop {
        let generation = self.process.child_token();
        GenerationStop {
            sources: generation.child_token(),
            outputs: generation.child_token(),
        }
    }

    /// Stops the process-wide parts (after the generation has drained).
    pub(super) fn stop(&self) {
        self.process.cancel();
    }
}

/// One generation's stops: its sources first, its local outputs last.
pub(super) struct GenerationStop {
    pub(super) sources: CancellationToken,
    pub(super) outputs: CancellationToken,
}

impl GenerationStop {
    /// Tokens already cancelled (a generation with nothing in it).
    pub(super) fn stopped() -> GenerationStop {
        let t = CancellationToken::new();
        t.cancel();
        GenerationStop {
            sources: t.clone(),
            outputs: t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generation_stops_in_order_and_the_process_stops_everything() {
        let life = Lifecycle::new();
        let part = life.part();
        let g = life.generation();
        // A reload stops the sources first; the outputs keep going.
        g.sources.cancel();
        assert!(!g.outputs.is_cancelled() && !part.is_cancelled());
        let next = life.generation();
        life.stop();
        assert!(part.is_cancelled() && g.outputs.is_cancelled());
        assert!(next.sources.is_cancelled() && next.outputs.is_cancelled());
    }

    #[test]
    fn dropping_the_lifecycle_stops_what_it_started() {
        let life = Lifecycle::new();
        let part = life.part();
        let g = life.generation();
        drop(life);
        assert!(part.is_cancelled() && g.sources.is_cancelled() && g.outputs.is_cancelled());
        let s = GenerationStop::stopped();
        assert!(s.sources.is_cancelled() && s.outputs.is_cancelled());
    }
}
