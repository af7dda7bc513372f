//! Turning model outputs into result payloads.
