//! Intrusive doubly-linked lists over arena indices (`u32` prev/next links stored in the nodes),
//! used for the recency lists of the eviction policies and the ARC ghost lists. No allocation:
//! a list is a head, a tail and a length; the links live in the arena.

/// The "no node" link.
pub(crate) const NIL: u32 = u32::MAX;

/// A node's links. `prev` points toward the most recently used end (the head), `next` toward the
/// least recently used end (the tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) prev: u32,
    pub(crate) next: u32,
}

impl Link {
    /// A node on no list.
    pub(crate) const UNLINKED: Link = Link {
        prev: NIL,
        next: NIL,
    };
}

/// Arena nodes that carry a [`Link`].
pub(crate) trait Linked {
    fn link(&self) -> Link;
    fn link_mut(&mut self) -> &mut Link;
}

/// A list threaded through an arena: head is the most recent node, tail the least recent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct List {
    pub(crate) head: u32,
    pub(crate) tail: u32,
    pub(crate) len: u32,
}

impl Default for List {
    fn default() -> Self {
        Self::EMPTY
    }
}

impl List {
    /// A list with no node.
    pub(crate) const EMPTY: List = List {
        head: NIL,
        tail: NIL,
        len: 0,
    };

    /// Links the unlinked node `i` at the head.
    #[inline]
    pub(crate) fn push_front<T: Linked>(&mut self, nodes: &mut [T], i: u32) {
        debug_assert!(
            nodes[i as usize].link() == Link::UNLINKED,
            "node {i} already linked"
        );
        let old = self.head;
        *nodes[i as usize].link_mut() = Link {
            prev: NIL,
            next: old,
        };
        if old == NIL {
            debug_assert_eq!(self.len, 0);
            self.tail = i;
        } else {
            nodes[old as usize].link_mut().prev = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Unlinks node `i`, which must be on this list.
    #[inline]
    pub(crate) fn unlink<T: Linked>(&mut self, nodes: &mut [T], i: u32) {
        debug_assert!(self.len > 0);
        let Link { prev, next } = nodes[i as usize].link();
        if prev == NIL {
            debug_assert_eq!(self.head, i);
            self.head = next;
        } else {
            nodes[prev as usize].link_mut().next = next;
        }
        if next == NIL {
            debug_assert_eq!(self.tail, i);
            self.tail = prev;
        } else {
            nodes[next as usize].link_mut().prev = prev;
        }
        *nodes[i as usize].link_mut() = Link::UNLINKED;
        self.len -= 1;
    }

    /// Moves node `i`, which must be on this list, to the head.
    #[inline]
    pub(crate) fn move_to_front<T: Linked>(&mut self, nodes: &mut [T], i: u32) {
        if self.head == i {
            return;
        }
        self.unlink(nodes, i);
        self.push_front(nodes, i);
    }

    /// Moves the tail node to the head and returns it (`NIL` if the list is empty): what
    /// `unlink(tail)` then `push_front(tail)` do, with fewer link updates.
    #[inline]
    pub(crate) fn rotate_tail_to_front<T: Linked>(&mut self, nodes: &mut [T]) -> u32 {
        let t = self.tail;
        if t == NIL || t == self.head {
            return t;
        }
        let prev = nodes[t as usize].link().prev;
        nodes[prev as usize].link_mut().next = NIL;
        self.tail = prev;
        let old = self.head;
        *nodes[t as usize].link_mut() = Link {
            prev: NIL,
            next: old,
        };
        nodes[old as usize].link_mut().prev = t;
        self.head = t;
        t
    }

    /// Walks the list from head to tail, checking links both ways; returns the nodes in order.
    /// For invariant checks only (allocates).
    pub(crate) fn collect<T: Linked>(&self, nodes: &[T]) -> Result<Vec<u32>, String> {
        let mut out = Vec::with_capacity(self.len as usize);
        let mut prev = NIL;
        let mut i = self.head;
        while i != NIL {
            if out.len() > nodes.len() {
                return Err("list has a cycle".into());
            }
            let link = nodes[i as usize].link();
            if link.prev != prev {
                return Err(format!("node {i}: prev link {} != {prev}", link.prev));
            }
            out.push(i);
            prev = i;
            i = link.next;
        }
        if prev != self.tail {
            return Err(format!("tail {} != last node {prev}", self.tail));
        }
        if out.len() != self.len as usize {
            return Err(format!("list len {} != {} nodes", self.len, out.len()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy)]
    struct N(Link);
    impl Linked for N {
        fn link(&self) -> Link {
            self.0
        }
        fn link_mut(&mut self) -> &mut Link {
            &mut self.0
        }
    }

    #[test]
    fn push_move_unlink_pop_keep_order() {
        let mut nodes = vec![N(Link::UNLINKED); 5];
        let mut l = List::EMPTY;
        for i in 0..5 {
            l.push_front(&mut nodes, i);
        }
        assert_eq!(l.collect(&nodes).unwrap(), vec![4, 3, 2, 1, 0]);
        l.move_to_front(&mut nodes, 0);
        assert_eq!(l.collect(&nodes).unwrap(), vec![0, 4, 3, 2, 1]);
        l.unlink(&mut nodes, 3);
        assert_eq!(l.collect(&nodes).unwrap(), vec![0, 4, 2, 1]);
        assert_eq!(l.tail, 1);
        l.unlink(&mut nodes, 1);
        assert_eq!(l.collect(&nodes).unwrap(), vec![0, 4, 2]);
        l.unlink(&mut nodes, 0);
        l.unlink(&mut nodes, 2);
        assert_eq!(l.collect(&nodes).unwrap(), vec![4]);
        l.unlink(&mut nodes, 4);
        assert_eq!(l.collect(&nodes).unwrap(), Vec::<u32>::new());
        assert_eq!(l, List::EMPTY);
    }

    #[test]
    fn rotate_tail_to_front_matches_unlink_then_push() {
        for len in 0..5u32 {
            let mut nodes = vec![N(Link::UNLINKED); 5];
            let mut l = List::EMPTY;
            for i in 0..len {
                l.push_front(&mut nodes, i);
            }
            let mut want_nodes = nodes.clone();
            let mut want = l;
            let tail = want.tail;
            if tail != NIL {
                want.unlink(&mut want_nodes, tail);
                want.push_front(&mut want_nodes, tail);
            }
            assert_eq!(l.rotate_tail_to_front(&mut nodes), tail, "len {len}");
            assert_eq!(l, want, "len {len}");
            assert_eq!(
                l.collect(&nodes).unwrap(),
                want.collect(&want_nodes).unwrap(),
                "len {len}"
            );
        }
    }
}
