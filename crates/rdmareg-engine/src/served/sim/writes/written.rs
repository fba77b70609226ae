//! The simulator's model of the owner's log of written ranges, and its
//! check (invariant 8).

use super::{Checked, ReceiveId, Receiving, SLOT_STRIDE, Sim, State};

impl Sim {
    /// The model of invariant 8 as receive `id` ends: a completed one
    /// landed but where a failed one spoiled it; a failed one's range did
    /// not, nor did its overlap with every receive still running.
    pub(super) fn model_receive_end(
        &mut self,
        id: ReceiveId,
        receive: &Receiving,
        completed: bool,
    ) {
        self.ended.insert(id, completed);
        let range = receive.address..receive.address + receive.bytes.len() as u64;
        if !completed {
            for other in self.receiving.values_mut() {
                let end = other.address + other.bytes.len() as u64;
                other
                    .spoiled
                    .extend(other.address.max(range.start)..end.min(range.end));
            }
        }
        let Some((&region, r)) = self.regions.iter().find(|(_, r)| {
            r.state != State::Unmapped && range.start >= r.base && range.start < r.base + r.len
        }) else {
            return;
        };
        let Some(landed) = self.landed.get_mut(&region) else {
            return;
        };
        for address in range {
            landed[(address - r.base) as usize] = completed && !receive.spoiled.contains(&address);
        }
    }

    /// The owner's log of every region, taken: invariant 8 checked on it,
    /// and the model starts afresh.
    pub(super) fn take_written(&mut self) -> Checked {
        let ids: Vec<u64> = self.landed.keys().copied().collect();
        for id in ids {
            let Some(taken) = self.owner.take_written(id) else {
                return Err(format!("the owner has no written log of region {id}"));
            };
            self.check_listed(id, &taken)?;
            self.stats.listed_bytes += taken.listed_bytes();
            self.stats.incomplete_logs += u64::from(taken.incomplete);
            self.note(|| format!("region {id} written: {taken:?}"));
            if let Some(landed) = self.landed.get_mut(&id) {
                landed.fill(false);
            }
            if self.owner.take_written(id).is_some_and(|t| !t.is_empty()) {
                return Err(format!("a second take of region {id} listed something"));
            }
        }
        Ok(())
    }

    /// Invariant 8 on every region's log as it stands.
    pub(super) fn check_written(&self) -> Checked {
        for &id in self.landed.keys() {
            if let Some(listed) = self.owner.peek_written(id) {
                self.check_listed(id, &listed)?;
            }
        }
        Ok(())
    }

    pub(super) fn check_listed(&self, id: u64, listed: &rdmareg_core::WrittenRanges) -> Checked {
        let (Some(region), Some(landed)) = (self.regions.get(&id), self.landed.get(&id)) else {
            return Ok(());
        };
        let mut on_list = vec![false; landed.len()];
        for range in &listed.ranges {
            if range.is_empty() || range.end > region.len {
                return Err(format!(
                    "region {id} lists {range:?}, of {} bytes",
                    region.len
                ));
            }
            for offset in range.clone() {
                on_list[offset as usize] = true;
                let address = region.base + offset;
                let slot = (address / SLOT_STRIDE - 1) as usize;
                let at = (address % SLOT_STRIDE) as usize;
                let writer = self.last_writer[slot][at];
                let by_a_write = writer.is_some_and(|r| {
                    self.ended.get(&r) == Some(&true) || self.receiving.contains_key(&r)
                });
                if !by_a_write || !landed[offset as usize] {
                    return Err(format!(
                        "region {id} lists byte {offset}, which no completed write filled \
                         (last written by {writer:?}, landed: {})",
                        landed[offset as usize]
                    ));
                }
            }
        }
        if !listed.incomplete
            && let Some(offset) = (0..landed.len()).find(|&b| landed[b] && !on_list[b])
        {
            return Err(format!(
                "region {id}'s log says it is complete but leaves out landed byte {offset}"
            ));
        }
        Ok(())
    }
}
