//! Decoders against real files.
