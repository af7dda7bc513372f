//! Uplinks to the fleet.
