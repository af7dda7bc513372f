//! The bounded queue in front of each pipeline.
//!
//! Invariants: the queue never holds more than `capacity` frames; every frame
//! that does not reach a worker is counted under exactly one drop reason;
//! frames leave in arrival order. `block` makes the source wait for room
//! (back-pressure to a socket or broker) instead of dropping.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// What to do with a frame that arrives at a full queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenFull {
    /// Make room by dropping the oldest queued frame (fresh data matters most: sensors, video).
    #[default]
    DropOldest,
    /// Drop the arriving frame.
    DropNewest,
    /// Make the source wait until there is room.
    Block,
}

/// The outcome of offering a frame to a queue.
#[derive(Debug, PartialEq, Eq)]
pub enum Offer<T> {
    /// Queued.
    Queued,
    /// Queued; the oldest frame was dropped to make room (returned so a waiting caller can be answered).
    QueuedDroppedOldest(T),
    /// Not queued: dropped (drop_newest) — returned to the caller.
    Dropped(T),
    /// Not queued: the queue is full and the policy is block; try again when there is room.
    Full(T),
}

/// A bounded FIFO with a full-queue policy. Not synchronised: the scheduler wraps it.
#[derive(Debug)]
pub struct BoundedQueue<T> {
    items: VecDeque<T>,
    capacity: usize,
    when_full: WhenFull,
}

impl<T> BoundedQueue<T> {
    pub fn new(capacity: usize, when_full: WhenFull) -> Self {
        let capacity = capacity.max(1);
        BoundedQueue {
            items: VecDeque::with_capacity(capacity.min(4096)),
            capacity,
            when_full,
        }
    }

    pub fn offer(&mut self, item: T) -> Offer<T> {
        if self.items.len() < self.capacity {
            self.items.push_back(item);
            return Offer::Queued;
        }
        match self.when_full {
            WhenFull::DropOldest => {
                let old = self.items.pop_front();
                self.items.push_back(item);
                match old {
                    Some(o) => Offer::QueuedDroppedOldest(o),
                    // capacity >= 1 and the queue is full, so there was an oldest item.
                    None => Offer::Queued,
                }
            }
            WhenFull::DropNewest => Offer::Dropped(item),
            WhenFull::Block => Offer::Full(item),
        }
    }

    /// Takes up to `n` frames from the front.
    pub fn take(&mut self, n: usize) -> Vec<T> {
        let n = n.min(self.items.len());
        self.items.drain(..n).collect()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_oldest_keeps_the_newest() {
        let mut q = BoundedQueue::new(3, WhenFull::DropOldest);
        for i in 0..3 {
            assert_eq!(q.offer(i), Offer::Queued);
        }
        assert_eq!(q.offer(3), Offer::QueuedDroppedOldest(0));
        assert_eq!(q.offer(4), Offer::QueuedDroppedOldest(1));
        assert_eq!(q.take(10), vec![2, 3, 4]);
    }

    #[test]
    fn drop_newest_and_block_refuse_the_arrival() {
        let mut q = BoundedQueue::new(2, WhenFull::DropNewest);
        q.offer(1);
        q.offer(2);
        assert_eq!(q.offer(3), Offer::Dropped(3));
        assert_eq!(q.take(1), vec![1]);
        let mut q = BoundedQueue::new(1, WhenFull::Block);
        q.offer(1);
        assert_eq!(q.offer(2), Offer::Full(2));
        assert_eq!(q.len(), 1);
    }

    #[test]
    fn take_respects_order_and_bounds() {
        let mut q = BoundedQueue::new(10, WhenFull::DropOldest);
        for i in 0..5 {
            q.offer(i);
        }
        assert_eq!(q.take(2), vec![0, 1]);
        assert_eq!(q.take(10), vec![2, 3, 4]);
        assert!(q.is_empty());
    }
}
