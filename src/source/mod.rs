//! Frame sources.
