//! The operator's side of a fleet (`outpost fleet`): what the devices say
//! on the fleet broker, gathered without any state of our own (`status`);
//! staged rollouts, decided without I/O (`rollout`), whose documents go to
//! a directory or an S3-compatible bucket (`s3`, the one part here that
//! does I/O).

pub mod rollout;
pub mod s3;
pub mod status;
