//! The operator's side of a fleet (`outpost fleet`): what the devices say
//! on the fleet broker, gathered without any state of our own.

pub mod rollout;
pub mod status;
