//! Decoding payloads into model input tensors.
