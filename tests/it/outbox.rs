//! The outbox as a real store on disk.
