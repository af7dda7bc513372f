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

/// Latest frames per stream, served in turn: one lane per stream (a
/// camera of a pipeline reading several), each holding at most `capacity`
/// frames (a new one pushes the lane's oldest out), and `take` going round
/// the lanes one item at a time from where the last take stopped, so a
/// fast lane never keeps a slow one waiting.
///
/// Invariants: at most `capacity` items per lane; lanes are fixed at
/// construction (an item of no lane goes to the last, so nothing is lost
/// uncounted); within a lane, items leave in arrival order.
#[derive(Debug)]
pub struct LaneQueue<T> {
    lanes: Vec<VecDeque<T>>,
    capacity: usize,
    /// The lane the next take starts at.
    next: usize,
    len: usize,
}

impl<T> LaneQueue<T> {
    pub fn new(lanes: usize, capacity: usize) -> Self {
        let capacity = capacity.max(1);
        LaneQueue {
            lanes: (0..lanes.max(1))
                .map(|_| VecDeque::with_capacity(capacity.min(64)))
                .collect(),
            capacity,
            next: 0,
            len: 0,
        }
    }

    /// Queues `item` in `lane`; the lane's oldest comes back when it was full.
    pub fn offer(&mut self, lane: usize, item: T) -> Offer<T> {
        let last = self.lanes.len() - 1;
        let q = &mut self.lanes[lane.min(last)];
        q.push_back(item);
        if q.len() > self.capacity
            && let Some(old) = q.pop_front()
        {
            return Offer::QueuedDroppedOldest(old);
        }
        self.len += 1;
        Offer::Queued
    }

    /// Up to `n` items, one per lane in turn, round and round.
    pub fn take(&mut self, n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(n.min(self.len));
        let lanes = self.lanes.len();
        let mut empty_in_a_row = 0;
        while out.len() < n && self.len > 0 && empty_in_a_row < lanes {
            let i = self.next;
            self.next = (self.next + 1) % lanes;
            match self.lanes[i].pop_front() {
                Some(item) => {
                    out.push(item);
                    self.len -= 1;
                    empty_in_a_row = 0;
                }
                None => empty_in_a_row += 1,
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A pipeline's queue: one FIFO, or a lane per camera.
#[derive(Debug)]
pub enum PipelineQueue<T> {
    Fifo(BoundedQueue<T>),
    Lanes(LaneQueue<T>),
}

impl<T> PipelineQueue<T> {
    /// Offers `item`; `lane` says whose it is (used by a queue of lanes).
    pub fn offer(&mut self, lane: usize, item: T) -> Offer<T> {
        match self {
            PipelineQueue::Fifo(q) => q.offer(item),
            PipelineQueue::Lanes(q) => q.offer(lane, item),
        }
    }

    pub fn take(&mut self, n: usize) -> Vec<T> {
        match self {
            PipelineQueue::Fifo(q) => q.take(n),
            PipelineQueue::Lanes(q) => q.take(n),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            PipelineQueue::Fifo(q) => q.len(),
            PipelineQueue::Lanes(q) => q.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_keep_their_latest_and_are_served_in_turn() {
        // Lane 0 is a fast camera (ten frames), lanes 1 and 2 slow (one each).
        let mut q = LaneQueue::new(3, 1);
        let mut dropped = 0;
        for i in 0..10 {
            if let Offer::QueuedDroppedOldest(_) = q.offer(0, (0, i)) {
                dropped += 1;
            }
        }
        assert_eq!(dropped, 9, "the fast lane keeps its latest frame only");
        q.offer(1, (1, 0));
        q.offer(2, (2, 0));
        assert_eq!(q.len(), 3);
        // One at a time, each lane gets its turn: the fast one cannot take two.
        assert_eq!(q.take(1), vec![(0, 9)]);
        q.offer(0, (0, 10));
        assert_eq!(q.take(1), vec![(1, 0)]);
        assert_eq!(q.take(1), vec![(2, 0)]);
        assert_eq!(q.take(1), vec![(0, 10)]);
        assert!(q.is_empty());
        // A batch takes one of each ready lane, going on from the lane
        // after the last one served.
        for l in 0..3 {
            q.offer(l, (l, 1));
        }
        assert_eq!(q.take(8), vec![(1, 1), (2, 1), (0, 1)]);
        assert!(q.take(8).is_empty());
    }

    #[test]
    fn a_deeper_lane_gives_one_item_per_turn() {
        let mut q = LaneQueue::new(2, 3);
        for i in 0..3 {
            q.offer(0, i);
        }
        q.offer(1, 10);
        assert_eq!(q.take(3), vec![0, 10, 1]);
        assert_eq!(q.take(3), vec![2]);
    }

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
