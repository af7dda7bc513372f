//! Keyframes waiting for a decoder that several cameras share, one line
//! per camera, taken in turn (free of GStreamer).
//!
//! Invariants:
//! - At most `per_camera` keyframes of one camera wait. A camera that sends
//!   more than the decoder takes loses its own oldest waiting keyframe (the
//!   newest is worth more), never another camera's.
//! - The decoder takes one keyframe from each camera with one waiting, in
//!   turn: a camera whose keyframe comes in waits for at most one keyframe
//!   of each other camera, however many another one sends.

use std::collections::VecDeque;

/// The lines of the cameras with keyframes waiting, in turn order.
#[derive(Debug)]
pub(super) struct Line<K, T> {
    per_camera: usize,
    /// Each camera with one keyframe waiting or more: the front one is next.
    turns: VecDeque<(K, VecDeque<T>)>,
}

impl<K: PartialEq, T> Line<K, T> {
    /// At most `per_camera` (at least one) keyframes of each camera wait.
    pub(super) fn new(per_camera: usize) -> Line<K, T> {
        Line {
            per_camera: per_camera.max(1),
            turns: VecDeque::new(),
        }
    }

    /// A keyframe of camera `camera` joins its line; when the line was
    /// full, the camera's oldest keyframe leaves it and is returned.
    pub(super) fn push(&mut self, camera: K, item: T) -> Option<T> {
        if let Some((_, line)) = self.turns.iter_mut().find(|(k, _)| *k == camera) {
            let out = if line.len() >= self.per_camera {
                line.pop_front()
            } else {
                None
            };
            line.push_back(item);
            return out;
        }
        // A camera with nothing waiting comes last in turn.
        self.turns.push_back((camera, VecDeque::from([item])));
        None
    }

    /// The next keyframe: the oldest of the camera whose turn it is, which
    /// then goes to the back of the turn if it has more waiting.
    pub(super) fn pop(&mut self) -> Option<(K, T)>
    where
        K: Clone,
    {
        let (camera, mut line) = self.turns.pop_front()?;
        let item = line.pop_front()?;
        if !line.is_empty() {
            self.turns.push_back((camera.clone(), line));
        }
        Some((camera, item))
    }

    /// Keyframes waiting, all cameras together.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.turns.iter().map(|(_, l)| l.len()).sum()
    }

    /// Takes every keyframe out (the decoder stops).
    pub(super) fn drain(&mut self) -> Vec<(K, T)>
    where
        K: Clone,
    {
        let mut out = Vec::new();
        while let Some(x) = self.pop() {
            out.push(x);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A camera sending keyframes far faster than the decoder takes them
    /// beside three sending one now and then: the three never lose one and
    /// each waits for at most one keyframe of each other camera; the fast
    /// one loses its own, oldest first.
    #[test]
    fn a_flooding_camera_loses_its_own_keyframes_and_never_delays_another_by_more_than_a_turn() {
        let mut line = Line::new(2);
        let mut lost = Vec::new();
        let mut served: Vec<(&str, u32)> = Vec::new();
        for tick in 0..300u32 {
            // The flood: ten keyframes a tick; the decoder takes one.
            for n in 0..10 {
                if let Some(old) = line.push("flood", tick * 10 + n) {
                    lost.push(old);
                }
            }
            if tick % 30 == 0 {
                for cam in ["gate", "yard", "dock"] {
                    assert!(line.push(cam, tick).is_none(), "{cam} lost a keyframe");
                }
            }
            if let Some(x) = line.pop() {
                served.push(x);
            }
            assert!(line.len() <= 2 + 3 * 2, "{} waiting", line.len());
        }
        while let Some(x) = line.pop() {
            served.push(x);
        }
        for cam in ["gate", "yard", "dock"] {
            let mine: Vec<u32> = served
                .iter()
                .filter(|(c, _)| *c == cam)
                .map(|(_, t)| *t)
                .collect();
            assert_eq!(mine, (0..300).step_by(30).collect::<Vec<_>>(), "{cam}");
        }
        // Each slow camera's keyframe was taken within one turn of every
        // camera (four) of its coming.
        for (i, (cam, t)) in served.iter().enumerate() {
            if *cam != "flood" {
                let came = *t as usize;
                assert!(i <= came + 4, "{cam}'s keyframe of tick {t} taken {i}th");
            }
        }
        // The flood lost nearly every keyframe, each older than what it kept.
        let kept = served.iter().filter(|(c, _)| *c == "flood").count();
        assert_eq!(lost.len() + kept, 3000);
        assert!(lost.windows(2).all(|w| w[0] < w[1]), "oldest first");
    }

    #[test]
    fn cameras_take_turns_one_keyframe_each_in_the_order_they_came() {
        let mut line = Line::new(2);
        line.push('a', 1);
        line.push('a', 2);
        line.push('b', 1);
        line.push('c', 1);
        line.push('c', 2);
        assert_eq!(line.push('a', 3), Some(1), "a's oldest leaves a full line");
        let order: Vec<(char, i32)> = std::iter::from_fn(|| line.pop()).collect();
        assert_eq!(order, [('a', 2), ('b', 1), ('c', 1), ('a', 3), ('c', 2)]);
        assert_eq!(line.len(), 0);
        line.push('b', 9);
        assert_eq!(line.drain(), [('b', 9)]);
    }
}
