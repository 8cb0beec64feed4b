"""The optimizer step both small trainings take (the demo target, the acceptance drafts)."""


def optimizer_step(model, optimizer, schedule, loss) -> float:
    """Backward, gradients clipped to norm 1, a step of the optimizer and of its schedule; returns the loss."""
    import torch

    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return round(loss.item(), 4)
