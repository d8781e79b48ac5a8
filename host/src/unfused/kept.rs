//! A layer's two most recent builds of one kind (plans, megakernel passes), keyed by the
//! addresses they were built for.

use crate::error::Result;

/// Plans, or the megakernel passes built over them, for the buffers of the current call and of
/// the ones before, each with its key (the addresses it was built for). A framework whose
/// optimizer hands the layer new buffers every step usually alternates between two: building
/// the plans again cost 0.2–0.7 ms per step (docs/PERF.md, "Steps over new buffers"), and a
/// CUDA graph captured over one set reads its plans and pass while eager steps use the other
/// ([`CapturedGraph::launch`](crate::driver::CapturedGraph::launch)); at most two are held.
pub(crate) struct Kept<K, P> {
    current: Option<(K, P)>,
    previous: Option<(K, P)>,
}

impl<K: PartialEq, P> Kept<K, P> {
    pub(crate) const fn new() -> Self {
        Self { current: None, previous: None }
    }

    pub(crate) fn current(&self) -> Option<&P> {
        self.current.as_ref().map(|(_, plans)| plans)
    }

    pub(crate) fn current_mut(&mut self) -> Option<&mut P> {
        self.current.as_mut().map(|(_, plans)| plans)
    }

    /// The set selecting `key` would drop, if any: `key` is not held and two sets are.
    pub(crate) fn dropped_by(&self, key: &K) -> Option<&P> {
        if self.holds(key) || self.current.is_none() {
            return None;
        }
        self.previous.as_ref().map(|(_, plans)| plans)
    }

    /// Drops every held set whose key `stale` says was built over something being dropped.
    pub(crate) fn remove_if(&mut self, stale: impl Fn(&K) -> bool) {
        for held in [&mut self.current, &mut self.previous] {
            if held.as_ref().is_some_and(|(key, _)| stale(key)) {
                *held = None;
            }
        }
    }

    /// The held sets, current first.
    pub(crate) fn held(&self) -> impl Iterator<Item = &P> {
        [&self.current, &self.previous].into_iter().flatten().map(|(_, plans)| plans)
    }

    /// Whether `key`'s plans are held, current or previous.
    pub(crate) fn holds(&self, key: &K) -> bool {
        [&self.current, &self.previous].into_iter().flatten().any(|(k, _)| k == key)
    }

    /// Makes `key`'s plans the current ones: they already are, or the previous set is swapped
    /// back in, or `build` makes them (the current set, if any, becomes the previous one first,
    /// and a failed build leaves no set current). The caller checked the buffers' lengths against the
    /// config for this call, so plans built for the same addresses read the same extents.
    pub(crate) fn select(&mut self, key: K, build: impl FnOnce() -> Result<P>) -> Result<()> {
        if self.current.as_ref().is_some_and(|(k, _)| *k == key) {
            return Ok(());
        }
        let displaced = self.current.take();
        if let Some(previous) = self.previous.take_if(|(k, _)| *k == key) {
            (self.current, self.previous) = (Some(previous), displaced);
            return Ok(());
        }
        if displaced.is_some() {
            self.previous = displaced;
        }
        self.current = Some((key, build()?));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Kept;
    use crate::error::MokError;

    #[test]
    fn kept_sets_build_each_key_once_while_two_alternate_and_keep_two_at_most() {
        let mut kept: Kept<u32, String> = Kept::new();
        let builds = std::cell::RefCell::new(Vec::new());
        let select = |kept: &mut Kept<u32, String>, key: u32, fail: bool| {
            let result = kept.select(key, || {
                builds.borrow_mut().push(key);
                if fail {
                    Err(MokError::InvalidInput { tensor: "plans", problem: "build failed".into() })
                } else {
                    Ok(format!("plans {key}"))
                }
            });
            (result.is_ok(), kept.current().cloned())
        };
        assert_eq!(select(&mut kept, 1, false), (true, Some("plans 1".into())));
        assert_eq!(select(&mut kept, 1, false), (true, Some("plans 1".into())));
        // Two sets alternating: each built once, then swapped back and forth.
        for _ in 0..3 {
            assert_eq!(select(&mut kept, 2, false), (true, Some("plans 2".into())));
            assert_eq!(select(&mut kept, 1, false), (true, Some("plans 1".into())));
        }
        assert!(kept.holds(&1) && kept.holds(&2) && !kept.holds(&3));
        assert_eq!(kept.dropped_by(&3).map(String::as_str), Some("plans 2"));
        assert_eq!(kept.dropped_by(&2), None);
        // A third key replaces the older set: 2 is built again after it.
        assert_eq!(select(&mut kept, 3, false), (true, Some("plans 3".into())));
        assert!(kept.holds(&3) && kept.holds(&1) && !kept.holds(&2));
        assert_eq!(select(&mut kept, 2, false), (true, Some("plans 2".into())));
        assert_eq!(*builds.borrow(), [1, 2, 3, 2]);
        // A failed build leaves no set current and keeps the one it displaced.
        assert_eq!(select(&mut kept, 4, true), (false, None));
        assert_eq!(select(&mut kept, 2, false), (true, Some("plans 2".into())));
        assert_eq!(*builds.borrow(), [1, 2, 3, 2, 4]);
        // A set removed as stale: the other stays held, and the next build keeps it.
        assert_eq!(select(&mut kept, 5, false), (true, Some("plans 5".into())));
        kept.remove_if(|&key| key == 5);
        assert!(kept.current().is_none() && kept.holds(&2) && !kept.holds(&5));
        assert_eq!(kept.dropped_by(&6), None);
        assert_eq!(select(&mut kept, 6, false), (true, Some("plans 6".into())));
        assert!(kept.holds(&2) && kept.holds(&6));
        assert_eq!(*builds.borrow(), [1, 2, 3, 2, 4, 5, 6]);
    }
}
