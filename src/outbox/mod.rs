//! The durable outbox (sled).
