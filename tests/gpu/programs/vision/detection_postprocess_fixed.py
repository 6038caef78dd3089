# Case: RetinaNet-style detection post-processing on a dedicated CUDA stream, with the results
# copied to the host through non_blocking device-to-host copies and turned into COCO json rows.
# Source: box decoding follows torchvision.models.detection._utils.BoxCoder.decode_single and
#   RetinaNet.postprocess_detections (topk of flattened class scores); the fixed-size "Fast NMS"
#   follows YOLACT (dbolya/yolact layers/functions/detection.py fast_nms). The batched
#   non_blocking D2H copies followed by one synchronisation follow roboflow/rf-detr PR #1420;
#   missing-sync D2H bugs of this kind: pytorch/pytorch #86264, sgl-project/sglang PR #16493.
# FIXED: an event is recorded on the post-processing stream after the D2H copies and the host
#   blocks on it with Event.synchronize() before reading the pinned buffers with .tolist().
import math
import torch
import torch.nn as nn


def box_iou(a, b):
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    return inter / (area_a[:, None] + area_b[None] - inter)


class BoxCoder:
    def __init__(self, weights=(1.0, 1.0, 1.0, 1.0), clip=math.log(1000.0 / 16)):
        self.weights, self.clip = weights, clip

    def decode_single(self, rel_codes, boxes):
        wx, wy, ww, wh = self.weights
        widths, heights = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        ctr_x, ctr_y = boxes[:, 0] + 0.5 * widths, boxes[:, 1] + 0.5 * heights
        dx, dy = rel_codes[:, 0] / wx, rel_codes[:, 1] / wy
        dw = (rel_codes[:, 2] / ww).clamp(max=self.clip)
        dh = (rel_codes[:, 3] / wh).clamp(max=self.clip)
        px, py = dx * widths + ctr_x, dy * heights + ctr_y
        pw, ph = torch.exp(dw) * widths, torch.exp(dh) * heights
        return torch.stack([px - 0.5 * pw, py - 0.5 * ph, px + 0.5 * pw, py + 0.5 * ph], dim=1)


class RetinaNetLite(nn.Module):
    def __init__(self, num_classes=20, num_anchors=9):
        super().__init__()
        self.C, self.A = num_classes, num_anchors
        self.backbone = nn.Sequential(nn.Conv2d(3, 64, 7, 4, 3), nn.ReLU(), nn.Conv2d(64, 128, 3, 2, 1), nn.ReLU(),
                                      nn.Conv2d(128, 128, 3, 2, 1), nn.ReLU())
        self.cls_head = nn.Sequential(nn.Conv2d(128, 128, 3, 1, 1), nn.ReLU(), nn.Conv2d(128, num_anchors * num_classes, 3, 1, 1))
        self.reg_head = nn.Sequential(nn.Conv2d(128, 128, 3, 1, 1), nn.ReLU(), nn.Conv2d(128, num_anchors * 4, 3, 1, 1))

    def forward(self, images):
        f = self.backbone(images)
        n = images.shape[0]
        cls = self.cls_head(f).permute(0, 2, 3, 1).reshape(n, -1, self.C)
        reg = self.reg_head(f).permute(0, 2, 3, 1).reshape(n, -1, 4)
        return cls, reg


def make_anchors(fh, fw, stride, sizes=(32, 64, 128), ratios=(0.5, 1.0, 2.0), device="cuda"):
    base = torch.tensor([[-s * math.sqrt(1 / r) / 2, -s * math.sqrt(r) / 2, s * math.sqrt(1 / r) / 2, s * math.sqrt(r) / 2]
                         for s in sizes for r in ratios], device=device)
    ys, xs = torch.meshgrid(torch.arange(fh, device=device), torch.arange(fw, device=device), indexing="ij")
    shifts = (torch.stack([xs, ys, xs, ys], -1).reshape(-1, 1, 4).float() + 0.5) * stride
    return (shifts + base[None]).reshape(-1, 4)


class DetectionPostProcessor:
    def __init__(self, score_thresh=0.05, nms_thresh=0.5, detections_per_img=100):
        self.box_coder = BoxCoder()
        self.score_thresh, self.nms_thresh, self.k = score_thresh, nms_thresh, detections_per_img
        self.stream = torch.cuda.Stream()

    def fast_nms(self, boxes, scores):
        iou = box_iou(boxes, boxes).triu_(diagonal=1)
        keep = iou.max(dim=0).values <= self.nms_thresh
        return scores * keep * (scores > self.score_thresh)

    def __call__(self, cls_logits, box_regression, anchors, image_size):
        self.stream.wait_stream(torch.cuda.current_stream())
        cls_logits.record_stream(self.stream)
        box_regression.record_stream(self.stream)
        results = []
        with torch.cuda.stream(self.stream):
            for logits, reg in zip(cls_logits, box_regression):
                scores, idx = torch.sigmoid(logits).flatten().topk(self.k)
                labels, anchor_idx = idx % logits.shape[1], idx // logits.shape[1]
                boxes = self.box_coder.decode_single(reg[anchor_idx], anchors[anchor_idx])
                boxes[:, 0::2].clamp_(0, image_size[1])
                boxes[:, 1::2].clamp_(0, image_size[0])
                scores = self.fast_nms(boxes, scores)
                results.append({"boxes": boxes.to("cpu", non_blocking=True),
                                "scores": scores.to("cpu", non_blocking=True),
                                "labels": labels.to("cpu", non_blocking=True)})
        copied = torch.cuda.Event()  # FIX: wait for the copies queued on self.stream
        copied.record(self.stream)
        copied.synchronize()
        return results


def to_coco(results, image_ids):
    rows = []
    for image_id, det in zip(image_ids, results):
        for (x0, y0, x1, y1), s, c in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
            if s > 0:
                rows.append({"image_id": image_id, "category_id": c, "bbox": [x0, y0, x1 - x0, y1 - y0], "score": s})
    return rows


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = RetinaNetLite().cuda().eval()
    post = DetectionPostProcessor()
    anchors = make_anchors(32, 32, 16)
    g = torch.Generator(device="cuda").manual_seed(0)
    coco_rows = []
    for it in range(4):
        images = torch.rand(2, 3, 512, 512, device="cuda", generator=g)
        cls_logits, box_regression = model(images)
        results = post(cls_logits, box_regression, anchors, (512, 512))
        coco_rows += to_coco(results, [2 * it, 2 * it + 1])
    torch.cuda.synchronize()
    print("detections", len(coco_rows), sum(r["score"] for r in coco_rows))


if __name__ == "__main__":
    main()
