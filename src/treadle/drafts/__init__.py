"""The draft kinds (``draft.kind``): each in its own folder, ``drafts/<kind>/``, beside the pieces they share."""
